#!/usr/bin/env bash
# Regenerates the committed gRPC stubs (strata/v1/*_pb2*.py) from proto/strata/v1/.
# Needs `pip install grpcio-tools==1.85.1`; commit the result.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m grpc_tools.protoc -I ../../proto --python_out=. --pyi_out=. --grpc_python_out=. \
  ../../proto/strata/v1/*.proto
touch strata/v1/__init__.py
