//! Helpers for tests of this crate and the crates above it (the `test-support` feature).

/// Whether the test runs as root, which it needs for `what`. Where it does not, it is
/// skipped, unless `STRATA_REQUIRE_PRIVILEGED=1`: CI (.ci/run) must not pass a test by
/// skipping it, so there the test fails.
pub fn root(what: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    assert!(
        std::env::var("STRATA_REQUIRE_PRIVILEGED").as_deref() != Ok("1"),
        "needs root ({what})"
    );
    eprintln!("not run: needs root ({what})");
    false
}
