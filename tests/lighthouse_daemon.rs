//! The `torchft_lighthouse` binary as a real process: address logging, HTTP, signals, bad flags.

#[allow(dead_code)] // only its TempDir is used here
mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_torchft_lighthouse");

/// Kills the child on drop so a failing test never leaks a daemon.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[&str]) -> (Daemon, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "info")
        .env_remove("TORCHFT_MIN_REPLICAS")
        .env_remove("TORCHFT_BIND")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let daemon = Daemon(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some(i) = line.find("lighthouse listening on ") {
                let rest = &line[i + "lighthouse listening on ".len()..];
                let addr = rest
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                let _ = tx.send(addr);
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("no address logged");
    (daemon, addr)
}

fn wait_exit(d: &mut Daemon, within: Duration) -> Option<i32> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Some(status) = d.0.try_wait().unwrap() {
            return status.code();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("daemon did not exit within {within:?}");
}

fn signal(d: &Daemon, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &d.0.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} failed");
}

#[test]
fn serves_http_and_exits_zero_on_sigterm() {
    let (mut d, addr) = spawn(&["--min_replicas", "1", "--bind", "127.0.0.1:0"]);
    assert!(addr.starts_with("http://127.0.0.1:"), "{addr}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let body = tokio::time::timeout(Duration::from_secs(10), async {
            reqwest::get(format!("{addr}/healthz"))
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        })
        .await
        .unwrap();
        assert_eq!(body, "ok");
    });
    signal(&d, "-TERM");
    assert_eq!(wait_exit(&mut d, Duration::from_secs(15)), Some(0));
}

#[test]
fn exits_zero_on_sigint_with_dash_flags() {
    let (mut d, _) = spawn(&[
        "--min-replicas",
        "2",
        "--bind",
        "127.0.0.1:0",
        "--quorum-tick-ms",
        "5",
    ]);
    signal(&d, "-INT");
    assert_eq!(wait_exit(&mut d, Duration::from_secs(15)), Some(0));
}

#[test]
fn bad_flags_exit_nonzero_with_message() {
    let cases: &[(&[&str], &str)] = &[
        (&["--min_replicas", "0"], "min_replicas"),
        (&["--min_replicas", "abc"], "min_replicas"),
        (&["--min_replicas", "1", "--nope"], "--nope"),
        (&[], "--min_replicas"),
        (
            &["--min_replicas", "1", "--bind", "192.0.2.1:1"],
            "cannot bind",
        ),
        (
            &["--min_replicas", "1", "--bind", "no port here"],
            "invalid bind address",
        ),
        (
            &[
                "--min_replicas",
                "1",
                "--bind",
                "127.0.0.1:0",
                "--event_log",
                "/nonexistent-dir/events.jsonl",
            ],
            "cannot open event log",
        ),
        (
            &["--min_replicas", "1", "--straggler_skew_pct", "0"],
            "straggler_skew_pct",
        ),
        (&["--min_replicas", "1", "--threads", "0"], "--threads"),
    ];
    for (args, message) in cases {
        let out = Command::new(BIN)
            .args(*args)
            .env_remove("TORCHFT_MIN_REPLICAS")
            .env_remove("TORCHFT_BIND")
            .env("RUST_LOG", "error")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}

/// The worker thread count the daemon logs as it starts, with `args` and `env` set.
fn logged_threads(args: &[&str], env: Option<&str>) -> usize {
    let mut command = Command::new(BIN);
    command
        .args(["--min_replicas", "1", "--bind", "127.0.0.1:0"])
        .args(args)
        .env_remove("TORCHFT_MIN_REPLICAS")
        .env_remove("TORCHFT_BIND")
        .env_remove("TORCHFT_RUNTIME_THREADS")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(v) = env {
        command.env("TORCHFT_RUNTIME_THREADS", v);
    }
    let mut child = command.spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut d = Daemon(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut threads = None;
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(30)) {
        if line.contains("lighthouse worker threads") {
            let n = line.rsplit("threads=").next().unwrap_or_default();
            threads = n.trim().parse::<usize>().ok();
        }
        if line.contains("lighthouse listening on") {
            break;
        }
    }
    signal(&d, "-TERM");
    assert_eq!(wait_exit(&mut d, Duration::from_secs(15)), Some(0));
    threads.expect("no worker thread count logged")
}

#[test]
fn worker_threads_follow_the_flag_then_the_environment_then_the_cores() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(logged_threads(&["--threads", "3"], Some("1")), 3);
    assert_eq!(logged_threads(&[], Some("1")), 1);
    assert_eq!(logged_threads(&[], None), cores);
    assert_eq!(
        logged_threads(&[], Some("")),
        cores,
        "an empty variable is unset"
    );
    assert_eq!(
        logged_threads(&[], Some(" ")),
        cores,
        "a blank variable is unset"
    );
}

#[test]
fn env_variables_configure_the_daemon() {
    let mut child = Command::new(BIN)
        .env("TORCHFT_MIN_REPLICAS", "3")
        .env("TORCHFT_BIND", "127.0.0.1:0")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut d = Daemon(child);
    let mut lines = BufReader::new(stderr).lines();
    let line = lines
        .by_ref()
        .map_while(Result::ok)
        .find(|l| l.contains("lighthouse listening on"))
        .expect("no address logged");
    assert!(line.contains("min_replicas=3"), "{line}");
    assert!(line.contains("http://127.0.0.1:"), "{line}");
    signal(&d, "-TERM");
    assert_eq!(wait_exit(&mut d, Duration::from_secs(15)), Some(0));
}

#[test]
fn event_log_records_the_start_and_survives_restarts() {
    let dir = std::env::temp_dir().join(format!("torchft-daemon-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("events.jsonl");
    let log_arg = log.to_str().unwrap();
    for _ in 0..2 {
        let (mut d, _addr) = spawn(&[
            "--min_replicas",
            "2",
            "--bind",
            "127.0.0.1:0",
            "--event_log",
            log_arg,
            "--allow_kill",
        ]);
        signal(&d, "-TERM");
        assert_eq!(wait_exit(&mut d, Duration::from_secs(10)), Some(0));
    }
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines
        .iter()
        .all(|e| e["kind"] == "lighthouse_started" && e["min_replicas"] == 2));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_killed_lighthouse_s_successor_answers_the_next_quorum_request_at_once() {
    // The manager-side client keeps its quorum stream between requests; SIGKILL takes the
    // stream's connection with it. The next request, to a successor on the same address,
    // is answered there (on a new stream), not failed back to the caller for a retry.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let args = ["--min_replicas", "1", "--join_timeout_ms", "0"];
    let (mut first, addr) = spawn(&[&args[..], &["--bind", "127.0.0.1:0"]].concat());
    let ask = Duration::from_secs(10);
    let member = torchft::proto::QuorumMember {
        replica_id: "a".into(),
        address: "http://a.example:1".into(),
        store_address: "a.example:2".into(),
        world_size: 1,
        ..Default::default()
    };
    let c = rt
        .block_on(torchft::client::LighthouseClient::connect(&addr, ask))
        .unwrap();
    rt.block_on(c.quorum(member.clone(), ask)).unwrap();
    first.0.kill().unwrap(); // SIGKILL
    first.0.wait().unwrap();
    let bind = addr.trim_start_matches("http://").to_string();
    let (_second, again) = spawn(&[&args[..], &["--bind", &bind]].concat());
    assert_eq!(again, addr);
    let q = rt.block_on(c.quorum(member, ask)).unwrap();
    assert_eq!(q.participants.len(), 1);
}

#[test]
fn a_lighthouse_sigkilled_more_often_than_the_progress_wait_still_gives_up_on_a_dead_holder() {
    // a commits step 4 and dies; the lighthouse is then SIGKILLed and restarted on the same
    // address every 1.5 s, with its state file, while b asks at step 3. Each life waits for
    // a only for what the silence the earlier lives saw left of the progress wait (4 s), not
    // for the whole wait from its own start (which no life would outlive): b gets a quorum,
    // and not before a was silent that long.
    let dir = common::TempDir::new("sigkilled");
    let state = dir.0.join("lighthouse.state");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let args = [
        "--min_replicas",
        "1",
        "--join_timeout_ms",
        "0",
        "--heartbeat_timeout_ms",
        "500",
        "--progress_wait_ms",
        "4000",
        "--state_file",
        state.to_str().unwrap(),
    ];
    let member = |id: &str, step| torchft::proto::QuorumMember {
        replica_id: id.into(),
        address: format!("http://{id}.example:1"),
        store_address: format!("{id}.example:2"),
        world_size: 1,
        step,
        ..Default::default()
    };
    let ask = Duration::from_secs(10);
    let (mut life, addr) = spawn(&[&args[..], &["--bind", "127.0.0.1:0"]].concat());
    let c = rt
        .block_on(torchft::client::LighthouseClient::connect(&addr, ask))
        .unwrap();
    let q = rt.block_on(c.quorum(member("a", 3), ask)).unwrap();
    let committed = Instant::now();
    let refused = rt
        .block_on(c.commit("a", q.quorum_id, 4, 0.0, ask))
        .unwrap();
    assert_eq!(refused, None);
    let bind = addr.trim_start_matches("http://").to_string();
    let mut issued = None;
    for n in 1..=10 {
        life.0.kill().unwrap(); // SIGKILL
        life.0.wait().unwrap();
        life = spawn(&[&args[..], &["--bind", &bind]].concat()).0;
        let beats = {
            let c = c.clone();
            rt.spawn(async move {
                loop {
                    let _ = c.heartbeat("b", Duration::from_secs(1)).await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };
        let got = rt.block_on(c.quorum(member("b", 3), Duration::from_millis(1_500)));
        beats.abort();
        match got {
            Ok(q) => {
                issued = Some((n, q, committed.elapsed()));
                break;
            }
            Err(e) => assert!(e.is_timeout(), "life {n}: {e}"),
        }
    }
    drop(life);
    let (n, q, after) = issued.expect("no quorum while the lighthouse kept being killed");
    let ids: Vec<&str> = q
        .participants
        .iter()
        .map(|m| m.replica_id.as_str())
        .collect();
    assert_eq!(ids, ["b"]);
    assert!(
        after >= Duration::from_millis(3_995),
        "a given up on {after:?} after it was last heard (life {n})"
    );
}
