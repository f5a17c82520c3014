//! Wire tests of failure detection: sessions between manager servers (or manager-like
//! clients) and a real lighthouse on 127.0.0.1:0.
//!
//! A replica group whose session ends (stream dropped, connection closed, process killed with
//! SIGKILL) is lost at once: the next quorum forms well before `heartbeat_timeout`, and the
//! other members hear of it on their sessions. A hang (session open, no heartbeats) is lost
//! after `heartbeat_timeout`; a slow group that heartbeats never is; a lighthouse restart is
//! not a death.
//!
//! The SIGKILL test re-runs this test binary as a child process acting as a manager (the
//! `child_manager` test, which does nothing unless the parent sets its environment).

mod common;
use common::bounded;
use common::groups;
use common::TEST_TIMEOUT;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use torchft::lighthouse::{LighthouseClient, LighthouseOptions, LighthouseServer};
use torchft::manager::{ManagerClient, ManagerOptions, ManagerServer};
use torchft::proto::{LostEvent, ManagerQuorumRequest, Quorum, QuorumMember, SessionEvent};

const CONNECT: Duration = Duration::from_secs(5);
/// Long enough that anything faster than it was not decided by heartbeat expiry.
const SLOW_HEARTBEAT: Duration = Duration::from_secs(5);
/// Half of `SLOW_HEARTBEAT`: a decision sooner than this came from the loss itself, not from
/// heartbeat expiry (what the tests tell apart), with room for a loaded machine's scheduling.
const BEFORE_EXPIRY: Duration = Duration::from_millis(2_500);

/// Environment of the child manager process: the lighthouse address and its replica id.
const CHILD_ADDR_ENV: &str = "TORCHFT_TEST_CHILD_LIGHTHOUSE";
const CHILD_ID_ENV: &str = "TORCHFT_TEST_CHILD_REPLICA";

/// Runs a test body with an overall timeout so a hang fails instead of blocking CI.
fn opts(heartbeat_timeout: Duration) -> LighthouseOptions {
    LighthouseOptions {
        min_replicas: 1,
        join_timeout: Duration::from_secs(30),
        quorum_tick: Duration::from_millis(10),
        heartbeat_timeout,
        // Not about the no-regression rules: no startup hold, no wait for progress.
        progress_wait: Duration::ZERO,
        state_file: None,
        hang_timeout: None,
    }
}

fn member(id: &str) -> QuorumMember {
    QuorumMember {
        replica_id: id.to_string(),
        address: format!("http://{id}.example:1"),
        store_address: format!("{id}.example:2"),
        step: 1,
        world_size: 1,
        ..Default::default()
    }
}

fn ids(q: &Quorum) -> Vec<String> {
    q.participants
        .iter()
        .map(|m| m.replica_id.clone())
        .collect()
}

/// A client on its own connection (so dropping it closes that connection).
async fn client(server: &LighthouseServer) -> LighthouseClient {
    LighthouseClient::connect(&server.address(), CONNECT)
        .await
        .unwrap()
}

/// Waits until `cond` holds, polling, or panics after `within`.
async fn eventually(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The next lost event on a session, within `within`.
async fn next_lost(
    stream: &mut tonic::Streaming<SessionEvent>,
    within: Duration,
) -> Option<LostEvent> {
    loop {
        match tokio::time::timeout(within, stream.message()).await {
            Ok(Ok(Some(SessionEvent { lost: Some(l) }))) => return Some(l),
            Ok(Ok(Some(_))) => continue,
            Ok(_) | Err(_) => return None,
        }
    }
}

/// Forms the quorum {a, b}: both ask at once (both heartbeated by their sessions).
async fn quorum_ab(ca: &LighthouseClient, cb: &LighthouseClient) -> Quorum {
    let (qa, qb) = tokio::join!(
        ca.quorum(member("a"), Duration::from_secs(5)),
        cb.quorum(member("b"), Duration::from_secs(5))
    );
    let (qa, qb) = (qa.unwrap(), qb.unwrap());
    assert_eq!(ids(&qa), ["a", "b"]);
    assert_eq!(qa.quorum_id, qb.quorum_id);
    qa
}

/// `a` asks for the next quorum in the background.
fn ask_a(ca: &LighthouseClient) -> tokio::task::JoinHandle<(Quorum, Instant)> {
    let ca = ca.clone();
    tokio::spawn(async move {
        let q = ca
            .quorum(member("a"), Duration::from_secs(20))
            .await
            .unwrap();
        (q, Instant::now())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_session_is_lost_at_once_and_announced() {
    bounded(async {
        let server = LighthouseServer::bind("127.0.0.1:0", opts(SLOW_HEARTBEAT))
            .await
            .unwrap();
        let (ca, cb) = (client(&server).await, client(&server).await);
        let mut sa = ca.session("a", CONNECT).await.unwrap();
        let sb = cb.session("b", CONNECT).await.unwrap();
        assert_eq!(server.num_sessions(), 2);
        let q1 = quorum_ab(&ca, &cb).await;

        // a asks again; b is healthy, so the round waits for it.
        let next = ask_a(&ca);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!next.is_finished(), "must wait for healthy b");

        // b's session stream is dropped (its h2 stream is reset, the connection stays).
        let dropped = Instant::now();
        drop(sb);
        let (q2, at) = next.await.unwrap();
        assert_eq!(ids(&q2), ["a"]);
        assert!(q2.quorum_id > q1.quorum_id);
        let gap = at.duration_since(dropped);
        assert!(gap < BEFORE_EXPIRY, "next quorum after {gap:?}");
        let lost = next_lost(&mut sa, Duration::from_secs(2)).await.unwrap();
        assert_eq!(lost.replica_id, "b");
        assert_eq!(lost.quorum_id, q1.quorum_id);
        assert_eq!(server.num_sessions(), 1);
        // The status page shows the loss.
        let status: serde_json::Value = reqwest::get(format!("{}/status", server.address()))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(status["lost"][0]["replica_id"], "b");
        assert_eq!(status["lost"][0]["quorum_id"], q1.quorum_id);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_connection_is_lost_at_once() {
    bounded(async {
        let server = LighthouseServer::bind("127.0.0.1:0", opts(SLOW_HEARTBEAT))
            .await
            .unwrap();
        let ca = client(&server).await;
        let mut sa = ca.session("a", CONNECT).await.unwrap();
        // b's session runs in a task on its own connection; the task is aborted and the
        // client dropped, which closes the connection.
        let cb = client(&server).await;
        let cb2 = cb.clone();
        let holder = tokio::spawn(async move {
            let mut s = cb2.session("b", CONNECT).await.unwrap();
            while let Ok(Some(_)) = s.message().await {}
        });
        eventually("b's session opens", CONNECT, || server.num_sessions() == 2).await;
        let q1 = quorum_ab(&ca, &cb).await;
        let next = ask_a(&ca);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!next.is_finished());

        let dropped = Instant::now();
        holder.abort();
        drop(cb);
        let (q2, at) = next.await.unwrap();
        assert_eq!(ids(&q2), ["a"]);
        let gap = at.duration_since(dropped);
        assert!(gap < BEFORE_EXPIRY, "next quorum after {gap:?}");
        let lost = next_lost(&mut sa, Duration::from_secs(2)).await.unwrap();
        assert_eq!(
            (lost.replica_id.as_str(), lost.quorum_id),
            ("b", q1.quorum_id)
        );
        server.shutdown().await;
    })
    .await;
}

/// Kills the child on drop, so a failing test leaves no process behind.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Not a test on its own: the body of the child process of
/// `killed_process_is_lost_at_once` (a manager-like client: session, heartbeats, quorum
/// requests). Returns at once unless that test's environment is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_manager() {
    let (Ok(addr), Ok(id)) = (std::env::var(CHILD_ADDR_ENV), std::env::var(CHILD_ID_ENV)) else {
        return;
    };
    let c = LighthouseClient::connect(&addr, CONNECT).await.unwrap();
    let mut session = c.session(&id, CONNECT).await.unwrap();
    let hb = c.clone();
    let hb_id = id.clone();
    tokio::spawn(async move {
        loop {
            let _ = hb.heartbeat(&hb_id, Duration::from_secs(1)).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    tokio::spawn(async move { while let Ok(Some(_)) = session.message().await {} });
    // Asks for quorums until killed (or until the test's overall bound).
    let end = Instant::now() + TEST_TIMEOUT;
    while Instant::now() < end {
        let _ = c.quorum(member(&id), Duration::from_secs(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_process_is_lost_at_once() {
    bounded(async {
        let server = LighthouseServer::bind("127.0.0.1:0", opts(SLOW_HEARTBEAT))
            .await
            .unwrap();
        let ca = client(&server).await;
        let mut sa = ca.session("a", CONNECT).await.unwrap();
        let exe = std::env::current_exe().unwrap();
        let mut child = ChildGuard(
            Command::new(exe)
                .args(["--exact", "child_manager", "--nocapture"])
                .env(CHILD_ADDR_ENV, server.address())
                .env(CHILD_ID_ENV, "b")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        eventually("the child's session opens", Duration::from_secs(20), || {
            server.num_sessions() == 2
        })
        .await;
        // The child keeps asking; a's request completes the quorum {a, b}.
        let q1 = ca
            .quorum(member("a"), Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(ids(&q1), ["a", "b"]);

        let killed = Instant::now();
        child.0.kill().unwrap(); // SIGKILL
                                 // a keeps stepping; the first quorum without b must come well before the timeout.
        let q_last = loop {
            let q = ca
                .quorum(member("a"), Duration::from_secs(20))
                .await
                .unwrap();
            if ids(&q) == ["a"] {
                break q;
            }
        };
        let gap = killed.elapsed();
        assert!(gap < BEFORE_EXPIRY, "next quorum after {gap:?}");
        let lost = next_lost(&mut sa, Duration::from_secs(2)).await.unwrap();
        assert_eq!(lost.replica_id, "b");
        assert!(lost.quorum_id >= q1.quorum_id && lost.quorum_id < q_last.quorum_id);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hang_is_lost_after_heartbeat_timeout_and_slow_is_not() {
    bounded(async {
        let timeout = Duration::from_millis(600);
        let server = LighthouseServer::bind("127.0.0.1:0", opts(timeout))
            .await
            .unwrap();
        let (ca, cb) = (client(&server).await, client(&server).await);
        let mut sa = ca.session("a", CONNECT).await.unwrap();
        let _sb = cb.session("b", CONNECT).await.unwrap();
        let q1 = quorum_ab(&ca, &cb).await;
        // Heartbeat acknowledgements state the timeout (the managers' commit lease).
        assert_eq!(
            ca.heartbeat_lease("a", None, None, CONNECT)
                .await
                .unwrap()
                .timeout,
            Some(timeout)
        );

        // Slow: both heartbeat for 3 heartbeat timeouts without asking; nobody is lost.
        let slow_until = Instant::now() + 3 * timeout;
        while Instant::now() < slow_until {
            ca.heartbeat("a", CONNECT).await.unwrap();
            cb.heartbeat("b", CONNECT).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // b hangs: its session stays open but it stops heartbeating; a keeps heartbeating.
        let hung = Instant::now();
        assert_eq!(next_lost(&mut sa, Duration::from_millis(100)).await, None);
        let hb = ca.clone();
        let a_alive = tokio::spawn(async move {
            loop {
                let _ = hb.heartbeat("a", CONNECT).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        let lost = next_lost(&mut sa, Duration::from_secs(5)).await.unwrap();
        let after = hung.elapsed();
        assert_eq!(
            (lost.replica_id.as_str(), lost.quorum_id),
            ("b", q1.quorum_id)
        );
        assert!(
            after >= timeout - Duration::from_millis(100) && after < timeout * 3,
            "hang declared after {after:?} (timeout {timeout:?})"
        );
        // The next quorum excludes it.
        let q2 = ca
            .quorum(member("a"), Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(ids(&q2), ["a"]);
        a_alive.abort();
        server.shutdown().await;
    })
    .await;
}

/// A single-rank group's options (see `groups::opts`).
fn manager_opts(replica_id: &str, lighthouse_addr: &str) -> ManagerOptions {
    groups::opts(replica_id, lighthouse_addr, 1)
}

fn rank_request(step: i64) -> ManagerQuorumRequest {
    ManagerQuorumRequest {
        group_rank: 0,
        step,
        checkpoint_metadata: "meta".into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manager_servers_forward_losses_and_survive_a_lighthouse_restart() {
    bounded(async {
        let lh = LighthouseServer::bind("127.0.0.1:0", opts(SLOW_HEARTBEAT))
            .await
            .unwrap();
        let addr = lh.address();
        let bind = lh.local_addr().to_string();
        let ma = ManagerServer::start(manager_opts("a", &addr))
            .await
            .unwrap();
        let mb = ManagerServer::start(manager_opts("b", &addr))
            .await
            .unwrap();
        let ra = ManagerClient::connect(&ma.address(), CONNECT)
            .await
            .unwrap();
        let rb = ManagerClient::connect(&mb.address(), CONNECT)
            .await
            .unwrap();
        eventually("both sessions open", CONNECT, || lh.num_sessions() == 2).await;

        // Lighthouse restart on the same port: sessions reopen, nobody is reported lost.
        lh.shutdown().await;
        drop(lh);
        let lh = LighthouseServer::bind(&bind, opts(SLOW_HEARTBEAT))
            .await
            .unwrap();
        eventually("sessions reopen", Duration::from_secs(10), || {
            lh.num_sessions() == 2
        })
        .await;
        let (none, seq) = ra
            .watch_events(0, Duration::from_millis(200))
            .await
            .unwrap();
        assert!(none.is_empty(), "restart reported as a loss: {none:?}");
        assert_eq!(seq, 0);

        let (qa, qb) = tokio::join!(
            ra.quorum(rank_request(1), Duration::from_secs(10)),
            rb.quorum(rank_request(1), Duration::from_secs(10))
        );
        let (qa, qb) = (qa.unwrap(), qb.unwrap());
        assert_eq!(qa.replica_world_size, 2);
        assert_eq!(qa.quorum_id, qb.quorum_id);

        // A rank of a is watching when b's manager goes away.
        let watcher = {
            let ra = ra.clone();
            tokio::spawn(async move { ra.watch_events(seq, Duration::from_secs(10)).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        let gone = Instant::now();
        mb.shutdown().await;
        drop(mb);
        let (events, last) = watcher.await.unwrap().unwrap();
        assert!(
            gone.elapsed() < Duration::from_secs(2),
            "{:?}",
            gone.elapsed()
        );
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].replica_id, "b");
        assert_eq!(events[0].quorum_id, qa.quorum_id);
        assert_eq!(last, 1);
        // Already seen: nothing more after it; a late poller from 0 still gets it.
        let (more, _) = ra
            .watch_events(last, Duration::from_millis(100))
            .await
            .unwrap();
        assert!(more.is_empty());
        assert_eq!(
            ra.watch_events(0, Duration::from_millis(100))
                .await
                .unwrap()
                .0,
            events
        );

        // The next quorum forms without b at once.
        let started = Instant::now();
        let q2 = ra
            .quorum(rank_request(2), Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(q2.replica_world_size, 1);
        assert!(started.elapsed() < BEFORE_EXPIRY, "{:?}", started.elapsed());
        ma.shutdown().await;
        lh.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_replies_tell_an_asking_group_why_its_round_waits() {
    bounded(async {
        let server = LighthouseServer::bind("127.0.0.1:0", opts(SLOW_HEARTBEAT))
            .await
            .unwrap();
        let (ca, cb) = (client(&server).await, client(&server).await);
        cb.heartbeat("b", CONNECT).await.unwrap();
        let asking = {
            let ca = ca.clone();
            tokio::spawn(async move { ca.quorum(member("a"), Duration::from_secs(30)).await })
        };
        // Nothing to say while the round is young.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let early = ca.heartbeat_lease("a", None, None, CONNECT).await.unwrap();
        assert_eq!(early.waiting, None);
        assert_eq!(early.timeout, Some(SLOW_HEARTBEAT));
        // Past two seconds the asking group hears why: the healthy group that does not ask,
        // and when the join timeout ends. The group that does not ask is told nothing.
        let start = Instant::now();
        let why = loop {
            cb.heartbeat("b", CONNECT).await.unwrap();
            if let Some(why) = ca
                .heartbeat_lease("a", None, None, CONNECT)
                .await
                .unwrap()
                .waiting
            {
                break why;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "no reason given");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(why.contains("healthy, not asking: b"), "{why}");
        assert!(why.contains("1 asking"), "{why}");
        let quiet = cb.heartbeat_lease("b", None, None, CONNECT).await.unwrap();
        assert_eq!(quiet.waiting, None);
        // Once the round is issued there is nothing to explain.
        let q = cb.quorum(member("b"), CONNECT).await.unwrap();
        assert_eq!(asking.await.unwrap().unwrap().quorum_id, q.quorum_id);
        let after = ca.heartbeat_lease("a", None, None, CONNECT).await.unwrap();
        assert_eq!(after.waiting, None);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn heartbeats_carry_state_digests_and_two_groups_that_differ_are_stopped() {
    use torchft::proto::StateDigest;
    bounded(async {
        let server = LighthouseServer::bind("127.0.0.1:0", opts(SLOW_HEARTBEAT))
            .await
            .unwrap();
        let (ca, cb) = (client(&server).await, client(&server).await);
        ca.heartbeat("a", CONNECT).await.unwrap();
        cb.heartbeat("b", CONNECT).await.unwrap();
        let q = quorum_ab(&ca, &cb).await;
        let digest = |byte: u8| StateDigest {
            step: 10,
            ranks: vec![vec![byte; 8]],
        };
        // A bad digest (ranks of different lengths) is refused alone: the heartbeat, and so
        // the group's lease, still succeeds, and the step is acknowledged (not resent).
        let bad = StateDigest {
            step: 9,
            ranks: vec![vec![1; 8], vec![1; 4]],
        };
        let ack = ca
            .heartbeat_digest("a", Some(9), None, Some(bad), CONNECT)
            .await
            .unwrap();
        assert_eq!((ack.parity_step, ack.diverged), (9, None));
        // a asks for the next quorum; then the digests of step 10 differ: no majority of two.
        let asking = {
            let ca = ca.clone();
            tokio::spawn(async move { ca.quorum(member("a"), Duration::from_secs(30)).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let ack = ca
            .heartbeat_digest("a", Some(10), None, Some(digest(1)), CONNECT)
            .await
            .unwrap();
        assert_eq!((ack.parity_step, ack.diverged.as_deref()), (10, None));
        let ack = cb
            .heartbeat_digest("b", Some(10), None, Some(digest(2)), CONNECT)
            .await
            .unwrap();
        assert_eq!(ack.parity_step, 10);
        assert!(ack.diverged.unwrap().contains("no majority"));
        // a's waiting request ends with the verdict (DATA_LOSS), not with a quorum.
        let err = asking.await.unwrap().unwrap_err();
        assert!(matches!(err, torchft::error::Error::Diverged(_)), "{err:?}");
        assert!(ca
            .heartbeat_lease("a", None, None, CONNECT)
            .await
            .unwrap()
            .diverged
            .is_some());
        // Its joins and commits are refused from now on.
        let err = ca.quorum(member("a"), CONNECT).await.unwrap_err();
        assert!(matches!(err, torchft::error::Error::Diverged(_)), "{err:?}");
        assert!(cb
            .commit("b", q.quorum_id, 11, 0.0, CONNECT)
            .await
            .unwrap()
            .is_some());
        server.shutdown().await;
    })
    .await;
}

/// A manager server that shuts down while a heartbeat is in flight: the heartbeat must reach
/// the lighthouse before the session ends, or it would make the group healthy again there
/// until its heartbeat expires, and the survivors' next quorum would wait for it. Heartbeats
/// every millisecond keep one in flight at almost every shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_during_a_heartbeat_is_still_a_loss_at_once() {
    bounded(async {
        let lh = LighthouseServer::bind("127.0.0.1:0", opts(SLOW_HEARTBEAT))
            .await
            .unwrap();
        let addr = lh.address();
        let ma = ManagerServer::start(manager_opts("a", &addr))
            .await
            .unwrap();
        let ra = ManagerClient::connect(&ma.address(), CONNECT)
            .await
            .unwrap();
        let mut step = 0;
        for round in 0..4 {
            let id = format!("b{round}");
            let mb = ManagerServer::start(ManagerOptions {
                heartbeat_interval: Duration::from_millis(1),
                ..manager_opts(&id, &addr)
            })
            .await
            .unwrap();
            let rb = ManagerClient::connect(&mb.address(), CONNECT)
                .await
                .unwrap();
            eventually("b's session open", CONNECT, || lh.num_sessions() == 2).await;
            step += 1;
            let (qa, qb) = tokio::join!(
                ra.quorum(rank_request(step), Duration::from_secs(10)),
                rb.quorum(rank_request(step), Duration::from_secs(10))
            );
            assert_eq!(qa.unwrap().replica_world_size, 2);
            qb.unwrap();
            // Let a few heartbeats go by, then stop b in the middle of one.
            tokio::time::sleep(Duration::from_millis(30)).await;
            mb.shutdown().await;
            drop(mb);
            step += 1;
            let started = Instant::now();
            let q = ra
                .quorum(rank_request(step), Duration::from_secs(10))
                .await
                .unwrap();
            assert_eq!(q.replica_world_size, 1, "round {round}");
            assert!(
                started.elapsed() < BEFORE_EXPIRY,
                "round {round}: the quorum without {id} took {:?}, as long as a heartbeat \
                 expiry",
                started.elapsed()
            );
        }
        ma.shutdown().await;
        lh.shutdown().await;
    })
    .await;
}
