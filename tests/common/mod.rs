//! Helpers shared by the integration tests: each test file declares `mod common;`.

use std::future::Future;
use std::time::Duration;

/// The longest one test may run: a hung test fails instead of stalling the suite.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `f`, failing the test if it takes longer than [`TEST_TIMEOUT`].
pub async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_TIMEOUT, f)
        .await
        .expect("test timed out");
}
