//! Wire tests of a single-rank group's own lighthouse connection, which its hosting rank's
//! thread drives: the write-ahead commit and the quorum request on it, and what closes it.

mod common;
use common::groups::{
    dead_port, group, group_with, lighthouse, lighthouse_on, opts, req, round, Group, LONG,
};
use common::{alone, bounded, requester, serve_fake, FakeLighthouse};

use std::time::{Duration, Instant};

use tonic::{Request, Response, Status};
use torchft::error::Error;
use torchft::proto::{
    LighthouseHeartbeatRequest, LighthouseHeartbeatResponse, LighthouseQuorumRequest,
    LighthouseQuorumResponse, ManagerQuorumResponse,
};

/// `may_commit_blocking` on a thread outside any runtime, as a hosting rank's training
/// thread calls it: the thread drives the announcement's own connection.
fn commit_on_own_thread(g: &std::sync::Arc<Group>, step: i64) -> torchft::error::Result<bool> {
    let g = g.clone();
    std::thread::spawn(move || g.server.may_commit_blocking(step, LONG))
        .join()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_ranks_own_thread_commit_is_gated_like_the_shared_one_and_outlives_a_restart() {
    bounded(async {
        let lh = lighthouse(1).await;
        let bind = lh.local_addr().to_string();
        let g = std::sync::Arc::new(group("a", &lh.address(), 1).await);
        round(&g, 0, LONG).await[0].as_ref().unwrap();
        let blocking = |step| {
            let g = g.clone();
            tokio::task::spawn_blocking(move || commit_on_own_thread(&g, step))
        };
        assert!(
            !g.server.own_commit_link_open(),
            "dialled on first use only"
        );
        assert!(
            blocking(0).await.unwrap().unwrap(),
            "accepted in its quorum"
        );
        assert!(
            g.server.own_commit_link_open(),
            "the announcement went on its own link"
        );

        // The lighthouse stops gracefully: its session with the group ends first, the group
        // closes the link nothing drives between commits, and the stop does not wait for it
        // (it would wait out its grace for the answer to its last ping).
        let started = Instant::now();
        lh.shutdown().await;
        let took = started.elapsed();
        assert!(took < Duration::from_secs(3), "graceful stop took {took:?}");
        drop(lh);
        assert!(!g.server.own_commit_link_open());

        // Restarted on the same address: the next announcement dials it.
        let lh = lighthouse_on(&bind, 1).await;
        // Heartbeats find the new daemon first (a few periods), or the lease would rightly
        // fence the next step.
        tokio::time::sleep(Duration::from_millis(300)).await;
        round(&g, 1, LONG).await[0].as_ref().unwrap();
        assert!(
            blocking(1).await.unwrap().unwrap(),
            "accepted by the restarted lighthouse"
        );
        // The shared connection's answer to the same announcement is the same.
        assert!(g.server.may_commit(1, LONG).await.unwrap());
        lh.shutdown().await;

        // A lighthouse that cannot be reached: the announcement retries until its deadline,
        // then says no, as the shared connection's does, and the link is closed (a silent
        // connection would not be noticed otherwise).
        let dead =
            std::sync::Arc::new(group("b", &format!("http://127.0.0.1:{}", dead_port()), 1).await);
        let short = Duration::from_millis(600);
        let d = dead.clone();
        let started = Instant::now();
        let down = tokio::task::spawn_blocking(move || {
            std::thread::spawn(move || d.server.may_commit_blocking(2, short))
                .join()
                .unwrap()
        });
        assert!(!down.await.unwrap().unwrap(), "no lighthouse, no commit");
        let took = started.elapsed();
        assert!(took >= short - Duration::from_millis(50), "{took:?}");
        assert!(took < short + Duration::from_secs(2), "{took:?}");
        assert!(!dead.server.own_commit_link_open());
        assert!(!dead.server.may_commit(2, short).await.unwrap());
        dead.server.shutdown().await;

        // Inside a runtime it cannot block: it says so instead of stalling a worker.
        let err = g.server.may_commit_blocking(3, LONG).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("outside any tokio runtime")),
            "{err}"
        );
        g.server.shutdown().await;
    })
    .await;
}

/// A TCP relay to `target` whose connections can be silenced one by one (a middlebox that
/// drops a connection's packets without closing it): the relay's address, and the sender
/// that silences the `n`-th connection accepted (counted from 0) when it is sent `n`.
async fn silencing_relay(
    target: std::net::SocketAddr,
) -> (String, tokio::sync::watch::Sender<i64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let (silence, silenced) = tokio::sync::watch::channel(-1i64);
    tokio::spawn(async move {
        for n in 0i64.. {
            let Ok((mut down, _)) = listener.accept().await else {
                return;
            };
            let mut silenced = silenced.clone();
            tokio::spawn(async move {
                let Ok(mut up) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                let silent = tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut down, &mut up) => false,
                    r = silenced.wait_for(|s| *s == n) => r.is_ok(),
                };
                if silent {
                    // Both sockets stay open, nothing passes any more, until the relay's
                    // owner drops the sender.
                    while silenced.changed().await.is_ok() {}
                }
            });
        }
    });
    (addr, silence)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_ranks_commit_connection_that_goes_silent_is_replaced_within_the_deadline() {
    bounded(async {
        let lh = lighthouse(1).await;
        let (relay, silence) = silencing_relay(lh.local_addr()).await;
        let g = std::sync::Arc::new(group("a", &relay, 1).await);
        // Connection 0 is the server's shared one (heartbeats, the session, quorums).
        round(&g, 0, LONG).await[0].as_ref().unwrap();
        let blocking = |step, timeout| {
            let g = g.clone();
            tokio::task::spawn_blocking(move || {
                std::thread::spawn(move || g.server.may_commit_blocking(step, timeout))
                    .join()
                    .unwrap()
            })
        };
        assert!(blocking(0, LONG).await.unwrap().unwrap());
        assert!(g.server.own_commit_link_open());
        // Connection 1, the own commit connection, goes silent; heartbeats still pass on 0,
        // so the lease holds and nothing but the announcement's own wait can notice.
        silence.send(1).unwrap();
        let deadline = torchft::manager::OWN_LINK_TRY * 3;
        let started = Instant::now();
        assert!(
            blocking(1, deadline).await.unwrap().unwrap(),
            "the announcement is sent again on the shared connection and accepted"
        );
        let took = started.elapsed();
        assert!(took >= torchft::manager::OWN_LINK_TRY, "{took:?}");
        assert!(took < deadline, "{took:?}");
        assert!(
            !g.server.own_commit_link_open(),
            "the silent connection was closed"
        );
        // The next announcement dials a new connection, which answers.
        let started = Instant::now();
        assert!(blocking(2, LONG).await.unwrap().unwrap());
        assert!(started.elapsed() < torchft::manager::OWN_LINK_TRY);
        assert!(g.server.own_commit_link_open());
        g.server.shutdown().await;
        // Once shut down, the answer is no, as the shared path's, and nothing is dialled.
        assert!(!blocking(3, LONG).await.unwrap().unwrap());
        assert!(!g.server.may_commit(3, LONG).await.unwrap());
        assert!(!g.server.own_commit_link_open());
        drop(silence); // the silenced connection closes
        lh.shutdown().await;
    })
    .await;
}

/// Starts `step`'s quorum of group rank 0 with `quorum_start_blocking` on a thread outside
/// any runtime, as a hosting rank's training thread does; the started request comes back.
async fn start_on_own_thread(
    g: &std::sync::Arc<Group>,
    step: i64,
    timeout: Duration,
) -> torchft::error::Result<torchft::manager::OwnQuorum> {
    let g = g.clone();
    off_runtime(move || g.server.quorum_start_blocking(req(0, step), timeout)).await
}

/// Runs `f` on a thread of its own, outside any runtime (a blocking task of the test's
/// runtime is inside it).
async fn off_runtime<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(move || std::thread::spawn(f).join().unwrap())
        .await
        .unwrap()
}

/// Waits for a started quorum on a thread outside any runtime.
async fn wait_on_own_thread(
    q: torchft::manager::OwnQuorum,
) -> torchft::error::Result<ManagerQuorumResponse> {
    off_runtime(move || q.wait()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_ranks_own_thread_quorum_is_on_the_wire_before_it_is_waited_for() {
    bounded(async {
        // Two groups needed: the other group's quorum forms only once this one's request
        // has reached the lighthouse.
        let lh = lighthouse(2).await;
        // Heartbeats (which may start a backstop driving a request left alone, after one
        // interval) slower than b's round below may take if a's request is on the wire.
        let mut o = opts("a", &lh.address(), 1);
        o.heartbeat_interval = Duration::from_millis(700);
        let a = std::sync::Arc::new(group_with(o).await);
        let b = group("b", &lh.address(), 1).await;
        for step in 0..3 {
            let started = start_on_own_thread(&a, step, LONG).await.unwrap();
            // The first goes from the server's tasks (the own connection is dialled by the
            // first commit announcement below), the others on the own connection.
            assert_eq!(started.on_own_link(), step > 0, "step {step}");
            // Nobody drives a's connection now: b's answer proves a's request was written.
            let began = Instant::now();
            let theirs = round(&b, step, LONG).await.remove(0).unwrap();
            let took = began.elapsed();
            assert!(
                took < Duration::from_millis(500),
                "step {step}: b waited {took:?}"
            );
            assert_eq!(theirs.replica_world_size, 2, "step {step}");
            // The answer came meanwhile: `is_done` reads it without waiting.
            let mut done = false;
            for _ in 0..200 {
                let s = &started;
                done = std::thread::scope(|t| t.spawn(|| s.is_done()).join().unwrap());
                if done {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(done, "step {step}: the answer was not read");
            let mine = wait_on_own_thread(started).await.unwrap();
            assert_eq!(mine.quorum_id, theirs.quorum_id);
            assert_eq!(mine.replica_world_size, 2);
            assert_eq!(mine.store_address, theirs.store_address);
            assert_eq!(mine.max_step, theirs.max_step);
            assert!(commit_on_own_thread(&a, step).unwrap());
        }
        assert!(a.server.own_commit_link_open());
        // The handler's own checks answer as they do for the client's call.
        let bad = {
            let a = a.clone();
            off_runtime(move || a.server.quorum_start_blocking(req(1, 3), LONG)?.wait()).await
        };
        assert!(matches!(bad, Err(Error::InvalidArgument(_))), "{bad:?}");
        // Inside a runtime it cannot block, and a group of several ranks asks through
        // its clients.
        let err = a.server.quorum_start_blocking(req(0, 3), LONG).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let two = std::sync::Arc::new(group("c", &lh.address(), 2).await);
        let err = start_on_own_thread(&two, 0, LONG).await.unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("group of one rank")),
            "{err}"
        );
        two.server.shutdown().await;
        // A request dropped unanswered is cancelled: its group leaves the lighthouse's round,
        // and the next one is answered.
        let dropped = start_on_own_thread(&a, 3, LONG).await.unwrap();
        assert!(dropped.on_own_link());
        off_runtime(move || drop(dropped)).await;
        let started = start_on_own_thread(&a, 3, LONG).await.unwrap();
        round(&b, 3, LONG).await.remove(0).unwrap();
        assert_eq!(
            wait_on_own_thread(started)
                .await
                .unwrap()
                .replica_world_size,
            2
        );
        a.server.shutdown().await;
        let err = start_on_own_thread(&a, 4, LONG).await.unwrap_err();
        assert!(matches!(err, Error::Shutdown), "{err}");
        assert!(!a.server.own_commit_link_open());
        b.server.shutdown().await;
        lh.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_ranks_quorum_in_flight_rides_out_a_lighthouse_restart() {
    bounded(async {
        let lh = lighthouse(2).await;
        let bind = lh.local_addr().to_string();
        let group_retrying = |id: &str| {
            let mut o = opts(id, &lh.address(), 1);
            o.quorum_retries = 100;
            group_with(o)
        };
        let a = std::sync::Arc::new(group_retrying("a").await);
        let b = group_retrying("b").await;
        let started = start_on_own_thread(&a, 0, LONG).await.unwrap();
        round(&b, 0, LONG).await.remove(0).unwrap();
        wait_on_own_thread(started).await.unwrap();
        assert!(commit_on_own_thread(&a, 0).unwrap()); // dials the own connection

        // a's next request waits at the lighthouse (b has not asked) when it stops, and
        // nobody waits for it: closing the connection under it starts a backstop thread,
        // and the request is sent again on the shared connection until the restarted
        // lighthouse answers it with b.
        let started = start_on_own_thread(&a, 1, LONG).await.unwrap();
        assert!(started.on_own_link());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let began = Instant::now();
        lh.shutdown().await;
        let took = began.elapsed();
        assert!(took < Duration::from_secs(3), "graceful stop took {took:?}");
        drop(lh);
        // The group sees its session end and closes its own connection.
        for _ in 0..100 {
            if !a.server.own_commit_link_open() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!a.server.own_commit_link_open());
        tokio::time::sleep(Duration::from_millis(300)).await;
        let lh = lighthouse_on(&bind, 2).await;
        // b's round forms only with a's request, sent again while a is away.
        let theirs = round(&b, 1, LONG).await.remove(0).unwrap();
        let waiting = tokio::spawn(wait_on_own_thread(started));
        let mine = waiting.await.unwrap().unwrap();
        assert_eq!(mine.quorum_id, theirs.quorum_id);
        assert_eq!(mine.replica_world_size, 2);
        // The next request goes from the server's tasks, and its commit announcement dials
        // a new own connection, which the one after takes.
        for step in 2..4 {
            let started = start_on_own_thread(&a, step, LONG).await.unwrap();
            assert_eq!(started.on_own_link(), step > 2);
            round(&b, step, LONG).await.remove(0).unwrap();
            wait_on_own_thread(started).await.unwrap();
            assert!(commit_on_own_thread(&a, step).unwrap());
        }
        assert!(a.server.own_commit_link_open());
        a.server.shutdown().await;
        b.server.shutdown().await;
        lh.shutdown().await;
    })
    .await;
}

/// A TCP relay to `target` whose connections can each be held (nothing passes either way,
/// both sockets stay open) and let go: the relay's address, and the sender that holds the
/// `n`-th connection accepted (counted from 0) while bit `n` of its value is set.
async fn holding_relay(target: std::net::SocketAddr) -> (String, tokio::sync::watch::Sender<u64>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let (hold, held) = tokio::sync::watch::channel(0u64);
    tokio::spawn(async move {
        for n in 0u32.. {
            let Ok((down, _)) = listener.accept().await else {
                return;
            };
            let Ok(up) = tokio::net::TcpStream::connect(target).await else {
                continue;
            };
            let (down_r, down_w) = down.into_split();
            let (up_r, up_w) = up.into_split();
            for (mut r, mut w) in [(down_r, up_w), (up_r, down_w)].map(|(r, w)| {
                (
                    Box::new(r) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                    Box::new(w) as Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
                )
            }) {
                let mut held = held.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let k = match r.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(k) => k,
                        };
                        if held.wait_for(|h| h & (1 << n) == 0).await.is_err() {
                            return;
                        }
                        if w.write_all(&buf[..k]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        }
    });
    (addr, hold)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_ranks_quorum_answered_late_is_dated_from_its_request() {
    bounded(async {
        let lh = lighthouse(2).await;
        let (relay, hold) = holding_relay(lh.local_addr()).await;
        // Heartbeats at a slower pace than the other tests': each one cut short by the hold
        // below resets its stream, and a burst of resets makes the lighthouse close the
        // connection (a defence against floods), which is not what this test is about.
        let mut o = opts("a", &relay, 1);
        o.heartbeat_interval = Duration::from_millis(300);
        let g = std::sync::Arc::new(group_with(o).await);
        // The other group reaches the lighthouse directly.
        let b = group("b", &lh.address(), 1).await;
        // Connection 0 is the shared one (heartbeats); the first commit announcement opens
        // the own one, connection 1.
        let started = start_on_own_thread(&g, 0, LONG).await.unwrap();
        round(&b, 0, LONG).await.remove(0).unwrap();
        wait_on_own_thread(started).await.unwrap();
        assert!(commit_on_own_thread(&g, 0).unwrap());
        assert!(g.server.lease_held());

        // The lighthouse answers the next request while the group is fine, but the answer
        // reaches it only after a lapse of its heartbeats longer than the lease (half the
        // lighthouse's 2 s timeout): the lighthouse may have declared the group lost in that
        // quorum meanwhile, so the lapse counts against it, though the answer came after.
        let started = start_on_own_thread(&g, 1, LONG).await.unwrap();
        assert!(started.on_own_link());
        tokio::time::sleep(Duration::from_millis(100)).await;
        hold.send(0b10).unwrap(); // the own connection: its answer waits in the relay
        round(&b, 1, LONG).await.remove(0).unwrap();
        hold.send(0b11).unwrap(); // and the heartbeats
        tokio::time::sleep(Duration::from_millis(1300)).await;
        hold.send(0b10).unwrap();
        // Heartbeats are acknowledged again (a few periods), which records the lapse; then
        // the answer comes through.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        hold.send(0).unwrap();
        wait_on_own_thread(started).await.unwrap();
        assert!(
            !g.server.lease_held(),
            "a lapse after the quorum was asked for fences the step"
        );
        // The next quorum, asked after the lapse, holds again.
        let started = start_on_own_thread(&g, 1, LONG).await.unwrap();
        round(&b, 1, LONG).await.remove(0).unwrap();
        wait_on_own_thread(started).await.unwrap();
        assert!(g.server.lease_held());
        g.server.shutdown().await;
        b.server.shutdown().await;
        lh.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_ranks_quorum_on_a_silent_connection_fails_that_request_only() {
    bounded(async {
        let lh = lighthouse(1).await;
        let (relay, hold) = holding_relay(lh.local_addr()).await;
        let g = std::sync::Arc::new(group("a", &relay, 1).await);
        let started = start_on_own_thread(&g, 0, LONG).await.unwrap();
        wait_on_own_thread(started).await.unwrap();
        assert!(commit_on_own_thread(&g, 0).unwrap()); // dials connection 1, the own one
        assert!(g.server.own_commit_link_open());
        // Connection 1 goes silent; the shared one still works. A quorum may
        // rightly wait long, so nothing cuts the request short: it times out at its
        // deadline, and the silent connection is closed.
        hold.send(0b10).unwrap();
        let deadline = Duration::from_secs(2);
        let began = Instant::now();
        let started = start_on_own_thread(&g, 1, deadline).await.unwrap();
        assert!(started.on_own_link());
        let err = wait_on_own_thread(started).await.unwrap_err();
        let took = began.elapsed();
        assert!(matches!(err, Error::Timeout(_)), "{err}");
        assert!(took >= deadline - Duration::from_millis(200), "{took:?}");
        assert!(took < deadline + Duration::from_secs(2), "{took:?}");
        assert!(
            !g.server.own_commit_link_open(),
            "the silent connection was closed"
        );
        // The next request goes on the shared connection at once, and the commit
        // announcement dials a new own connection, which the request after that takes.
        let began = Instant::now();
        for _ in 0..2 {
            let started = start_on_own_thread(&g, 1, LONG).await.unwrap();
            wait_on_own_thread(started).await.unwrap();
            assert!(commit_on_own_thread(&g, 1).unwrap());
        }
        assert!(began.elapsed() < Duration::from_secs(2));
        assert!(g.server.own_commit_link_open());
        g.server.shutdown().await;
        drop(hold);
        lh.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_ranks_quorum_left_alone_past_its_deadline_is_read_in_time_by_a_backstop() {
    bounded(async {
        let lh = lighthouse(2).await;
        let a = std::sync::Arc::new(group("a", &lh.address(), 1).await);
        let b = group("b", &lh.address(), 1).await;
        let c = std::sync::Arc::new(group("c", &lh.address(), 1).await);
        // A first step of a and b, whose commit announcement dials a's own connection.
        let started = start_on_own_thread(&a, 0, LONG).await.unwrap();
        let first = round(&b, 0, LONG).await.remove(0).unwrap();
        wait_on_own_thread(started).await.unwrap();
        assert!(commit_on_own_thread(&a, 0).unwrap());

        // The rank comes back to wait only after its request's deadline (a forward pass
        // longer than that). Meanwhile c joins, so the quorum is a new one: the server took
        // it in without the rank (a backstop thread read the answer when it came), and the
        // rank gets it, not a timeout.
        let deadline = Duration::from_millis(1000);
        let started = start_on_own_thread(&a, 1, deadline).await.unwrap();
        assert!(started.on_own_link());
        let joining = tokio::spawn({
            let c = c.clone();
            async move { round(&c, 1, LONG).await.remove(0).unwrap() }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let theirs = round(&b, 1, LONG).await.remove(0).unwrap();
        assert_eq!(theirs.replica_world_size, 3);
        assert_ne!(theirs.quorum_id, first.quorum_id);
        joining.await.unwrap();
        tokio::time::sleep(deadline + Duration::from_millis(500)).await;
        let seen = a.server.describe();
        assert!(
            seen.contains(&format!("quorum {};", theirs.quorum_id)),
            "{seen}"
        );
        let mine = wait_on_own_thread(started).await.unwrap();
        assert_eq!(mine.quorum_id, theirs.quorum_id);
        // And steps as usual go on.
        for step in 2..6 {
            let started = start_on_own_thread(&a, step, LONG).await.unwrap();
            assert!(started.on_own_link());
            let (rb, rc) = tokio::join!(round(&b, step, LONG), round(&c, step, LONG));
            rb[0].as_ref().unwrap();
            rc[0].as_ref().unwrap();
            wait_on_own_thread(started).await.unwrap();
        }
        a.server.shutdown().await;
        b.server.shutdown().await;
        c.server.shutdown().await;
        lh.shutdown().await;
    })
    .await;
}

/// A lighthouse as upstream's answers: single Quorum calls (a quorum of the asker alone)
/// and heartbeats, nothing else (no quorum or commit stream, no announcements, no
/// sessions). Records the peer each Quorum call came from.
#[derive(Default)]
struct UpstreamLike {
    peers: std::sync::Mutex<Vec<std::net::SocketAddr>>,
}

#[tonic::async_trait]
impl FakeLighthouse for std::sync::Arc<UpstreamLike> {
    async fn quorum(
        &self,
        request: Request<LighthouseQuorumRequest>,
    ) -> Result<Response<LighthouseQuorumResponse>, Status> {
        if let Some(peer) = request.remote_addr() {
            self.peers.lock().unwrap().push(peer);
        }
        Ok(alone(requester(request)?, 3))
    }

    async fn heartbeat(
        &self,
        _request: Request<LighthouseHeartbeatRequest>,
    ) -> Result<Response<LighthouseHeartbeatResponse>, Status> {
        Ok(Response::new(LighthouseHeartbeatResponse::default()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_rank_on_an_upstream_lighthouse_keeps_its_own_connection_across_steps() {
    bounded(async {
        let lh = std::sync::Arc::new(UpstreamLike::default());
        let (addr, stop, served) = serve_fake(lh.clone()).await;
        let g = std::sync::Arc::new(group("a", &addr, 1).await);
        for step in 0..5 {
            let started = start_on_own_thread(&g, step, LONG).await.unwrap();
            let answer = wait_on_own_thread(started).await.unwrap();
            assert_eq!(answer.quorum_id, 3);
            // No announcements there: the gate is local (and the lease holds).
            let g2 = g.clone();
            assert!(
                off_runtime(move || g2.server.may_commit_blocking(step, LONG))
                    .await
                    .unwrap()
            );
            assert!(g.server.own_commit_link_open());
        }
        // Every quorum went as a single call (no stream there): the first on the shared
        // connection, the others on the own one the first announcement dialled, kept from
        // step to step (none was dialled again for a step).
        let peers = lh.peers.lock().unwrap().clone();
        assert_eq!(peers.len(), 5, "{peers:?}");
        assert_ne!(peers[0], peers[1], "{peers:?}");
        assert!(peers[1..].iter().all(|p| *p == peers[1]), "{peers:?}");
        g.server.shutdown().await;
        stop.send(true).unwrap();
        served.await.unwrap();
    })
    .await;
}
