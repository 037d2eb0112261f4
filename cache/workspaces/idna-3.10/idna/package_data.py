__version__ = "3.10"
