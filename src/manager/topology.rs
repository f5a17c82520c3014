//! Where replica groups sit relative to each other, and which up-to-date group each healing
//! group recovers from.
//!
//! Two sources of locality:
//!
//! - A topology file (`WORLD_TOPOLOGY_FILE`, JSON, version 0.1): `ranks` → rank → `peers` →
//!   peer rank → `connection` with optional `latency`, `bandwidth` and `channels`. A rank is a
//!   process's job-wide rank, `replica_group_index * group_world_size + group_rank`. Each
//!   manager server announces its replica group index and a digest of its file in its quorum
//!   member's `data`; the file is used only when every member of the quorum announced the same
//!   digest (every group then computes the same assignment).
//! - Otherwise, host names: a source on the healer's host (taken from the member's manager
//!   address, i.e. the host of the group's rank 0) counts as ten times better connected than
//!   one elsewhere. Only when every member announced that it chooses sources this way (the
//!   `heal_sources` key of its `data`, which every manager server of this build sends).
//! - Otherwise (a member of an older build or of upstream torchft in the quorum): plain
//!   round-robin, `sources[(k + group_rank) % n]` for the k-th healer, exactly as those
//!   managers compute it.
//!
//! The assignment ([`assign_sources`]) is pure and deterministic: every group computes it from
//! the same quorum and gets the same answer, so sources and healers agree without talking.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::proto::QuorumMember;

/// The only topology file version understood.
pub const TOPOLOGY_VERSION: &str = "0.1";

/// Bytes a heal is assumed to move when weighing latency against bandwidth (1 GB).
const NOMINAL_HEAL_BYTES: f64 = 1e9;

/// The version of the source choice this build announces in its quorum member's `data`
/// (`{"heal_sources": 1}`). A member announcing any version ≥ 1 chooses by host locality when
/// no topology file applies; a later version must fall back to version 1's choice whenever a
/// member announces 1, so every group of a mixed quorum still computes the same assignment.
pub const HEAL_SOURCES_VERSION: u64 = 1;

/// Relative bandwidth of a source on the healer's own host, when no topology file applies.
const SAME_HOST_BANDWIDTH: f64 = 10.0;
/// Relative bandwidth of a source on another host, when no topology file applies.
const OTHER_HOST_BANDWIDTH: f64 = 1.0;

/// One directed connection of the topology file (every field optional in the file).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Link {
    /// One-way latency in seconds.
    pub latency_s: Option<f64>,
    /// Bandwidth in bytes per second.
    pub bandwidth_bps: Option<f64>,
    /// Number of channels (read and checked, not used in the cost model).
    pub channels: Option<u64>,
}

/// A parsed topology file.
#[derive(Debug, Clone, PartialEq)]
pub struct Topology {
    ranks: BTreeSet<u64>,
    /// (rank, peer) → the connection `rank` lists for `peer`.
    links: BTreeMap<(u64, u64), Link>,
    /// Bandwidth assumed for a listed link that gives none: the slowest listed bandwidth.
    default_bandwidth_bps: f64,
    digest: String,
}

fn bad(field: &str, what: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("topology file: field {field}: {what}"))
}

/// A JSON value that is a number or a string holding one.
fn number(v: &Value, field: &str) -> Result<f64> {
    let n = match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok(),
        _ => None,
    };
    match n {
        Some(n) if n.is_finite() && n >= 0.0 => Ok(n),
        _ => Err(bad(
            field,
            format!("must be a non-negative number (or a string holding one), got {v}"),
        )),
    }
}

fn object<'a>(v: &'a Value, field: &str) -> Result<&'a Map<String, Value>> {
    v.as_object()
        .ok_or_else(|| bad(field, format!("must be an object, got {v}")))
}

fn rank_key(key: &str, field: &str) -> Result<u64> {
    key.parse::<u64>().map_err(|_| {
        bad(
            field,
            format!("rank keys must be non-negative integers, got {key:?}"),
        )
    })
}

/// `{"value": ..., "measurement": ...}` → value scaled by the unit (`units`: name → factor).
fn measured(
    v: &Value,
    field: &str,
    units: &[(&str, f64)],
    default_unit: &str,
) -> Result<Option<f64>> {
    let obj = object(v, field)?;
    let value = obj
        .get("value")
        .ok_or_else(|| bad(&format!("{field}.value"), "missing"))?;
    let value = number(value, &format!("{field}.value"))?;
    let unit = match obj.get("measurement") {
        None => default_unit.to_string(),
        Some(Value::String(s)) => s.trim().to_string(),
        Some(other) => {
            return Err(bad(
                &format!("{field}.measurement"),
                format!("must be a string, got {other}"),
            ))
        }
    };
    // Exact first ("Gb/s" is bits, "GB/s" bytes); otherwise a case-insensitive match that
    // is unambiguous ("us" for "US").
    let loose: Vec<f64> = units
        .iter()
        .filter(|(name, _)| name.eq_ignore_ascii_case(&unit))
        .map(|(_, f)| *f)
        .collect();
    let factor = units
        .iter()
        .find(|(name, _)| *name == unit)
        .map(|(_, f)| *f)
        .or_else(|| (loose.len() == 1).then(|| loose[0]))
        .ok_or_else(|| {
            let known: Vec<&str> = units.iter().map(|(n, _)| *n).collect();
            bad(
                &format!("{field}.measurement"),
                format!("unknown unit {unit:?} (one of {})", known.join(", ")),
            )
        })?;
    let scaled = value * factor;
    if !scaled.is_finite() {
        return Err(bad(
            &format!("{field}.value"),
            format!("{value} {unit} is out of range"),
        ));
    }
    Ok(Some(scaled))
}

const LATENCY_UNITS: &[(&str, f64)] = &[("ns", 1e-9), ("us", 1e-6), ("ms", 1e-3), ("s", 1.0)];
const BANDWIDTH_UNITS: &[(&str, f64)] = &[
    ("B/s", 1.0),
    ("KB/s", 1e3),
    ("MB/s", 1e6),
    ("GB/s", 1e9),
    ("TB/s", 1e12),
    ("Kb/s", 1e3 / 8.0),
    ("Mb/s", 1e6 / 8.0),
    ("Gb/s", 1e9 / 8.0),
    ("Tb/s", 1e12 / 8.0),
];

/// 64-bit FNV-1a: a digest that is the same on every build and platform.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl Topology {
    /// Parses a topology file's text.
    ///
    /// Errors (`InvalidArgument`) name the offending field, e.g.
    /// `ranks."0".peers."1".connection.bandwidth.measurement`. Units: latency in ns/us/ms/s
    /// (default us), bandwidth in B/s, KB/s, MB/s, GB/s, TB/s or the bit rates Kb/s..Tb/s
    /// (default GB/s). Unknown fields are ignored (the format is meant to grow).
    pub fn parse(text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text)
            .map_err(|e| Error::InvalidArgument(format!("topology file: not valid JSON: {e}")))?;
        let root = object(&root, "(top level)")?;
        match root.get("version") {
            Some(Value::String(v)) if v.trim() == TOPOLOGY_VERSION => {}
            Some(v) => {
                return Err(bad(
                    "version",
                    format!("must be \"{TOPOLOGY_VERSION}\", got {v}"),
                ))
            }
            None => return Err(bad("version", "missing")),
        }
        let ranks_v = root.get("ranks").ok_or_else(|| bad("ranks", "missing"))?;
        let ranks_obj = object(ranks_v, "ranks")?;
        let mut ranks = BTreeSet::new();
        let mut links = BTreeMap::new();
        for (key, entry) in ranks_obj {
            let field = format!("ranks.{key:?}");
            let rank = rank_key(key, "ranks")?;
            ranks.insert(rank);
            let entry = object(entry, &field)?;
            let Some(peers) = entry.get("peers") else {
                continue;
            };
            let peers_field = format!("{field}.peers");
            for (peer_key, peer) in object(peers, &peers_field)? {
                let pfield = format!("{peers_field}.{peer_key:?}");
                let peer_rank = rank_key(peer_key, &peers_field)?;
                if peer_rank == rank {
                    return Err(bad(&pfield, "a rank must not list itself as a peer"));
                }
                let peer = object(peer, &pfield)?;
                let cfield = format!("{pfield}.connection");
                let mut link = Link::default();
                if let Some(conn) = peer.get("connection") {
                    let conn = object(conn, &cfield)?;
                    if let Some(v) = conn.get("latency") {
                        link.latency_s =
                            measured(v, &format!("{cfield}.latency"), LATENCY_UNITS, "us")?;
                    }
                    if let Some(v) = conn.get("bandwidth") {
                        let bw =
                            measured(v, &format!("{cfield}.bandwidth"), BANDWIDTH_UNITS, "GB/s")?;
                        if bw == Some(0.0) {
                            return Err(bad(&format!("{cfield}.bandwidth.value"), "must be > 0"));
                        }
                        link.bandwidth_bps = bw;
                    }
                    if let Some(v) = conn.get("channels") {
                        let f = format!("{cfield}.channels.value");
                        let value = object(v, &format!("{cfield}.channels"))?
                            .get("value")
                            .ok_or_else(|| bad(&f, "missing"))?;
                        let n = number(value, &f)?;
                        if n.fract() != 0.0 {
                            return Err(bad(&f, format!("must be a whole number, got {n}")));
                        }
                        link.channels = Some(n as u64);
                    }
                }
                links.insert((rank, peer_rank), link);
            }
        }
        if ranks.is_empty() {
            return Err(bad("ranks", "must list at least one rank"));
        }
        let default_bandwidth_bps = links
            .values()
            .filter_map(|l| l.bandwidth_bps)
            .fold(f64::INFINITY, f64::min);
        let default_bandwidth_bps = if default_bandwidth_bps.is_finite() {
            default_bandwidth_bps
        } else {
            OTHER_HOST_BANDWIDTH * 1e9
        };
        // The digest covers the parsed content (not the text's layout), so two files that
        // say the same thing agree.
        let mut canon = String::new();
        for r in &ranks {
            canon.push_str(&format!("r{r};"));
        }
        for ((a, b), l) in &links {
            canon.push_str(&format!(
                "l{a},{b},{:?},{:?},{:?};",
                l.latency_s, l.bandwidth_bps, l.channels
            ));
        }
        Ok(Self {
            ranks,
            links,
            default_bandwidth_bps,
            digest: format!("{:016x}", fnv1a(canon.as_bytes())),
        })
    }

    /// Reads and parses a topology file; errors name the file and the field.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::InvalidArgument(format!(
                "topology file {} cannot be read: {e}",
                path.display()
            ))
        })?;
        Self::parse(&text).map_err(|e| match e {
            Error::InvalidArgument(m) => Error::InvalidArgument(m.replacen(
                "topology file",
                &format!("topology file {}", path.display()),
                1,
            )),
            other => other,
        })
    }

    /// Digest of the parsed content (hex): members use the file only if all agree on it.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// Whether the file lists `rank`.
    pub fn has_rank(&self, rank: u64) -> bool {
        self.ranks.contains(&rank)
    }

    /// The connection between two ranks: as `to` (the receiver) lists `from`, else as `from`
    /// lists `to`; None when neither lists the other.
    pub fn link(&self, to: u64, from: u64) -> Option<&Link> {
        self.links
            .get(&(to, from))
            .or_else(|| self.links.get(&(from, to)))
    }

    /// Checks that every rank of replica group `group` (of `world_size` ranks) is listed, so
    /// a mismatched file fails when the manager starts rather than silently mid-heal.
    pub fn check_group(&self, group: u64, world_size: u64) -> Result<()> {
        let too_large = || {
            Error::InvalidArgument(format!(
                "replica group index {group} is too large for groups of {world_size} rank(s)"
            ))
        };
        let first = group.checked_mul(world_size).ok_or_else(too_large)?;
        let end = first.checked_add(world_size).ok_or_else(too_large)?;
        for rank in first..end {
            if !self.has_rank(rank) {
                return Err(bad(
                    &format!("ranks.\"{rank}\""),
                    format!(
                        "missing: replica group {group} of {world_size} rank(s) holds job-wide \
                         ranks {first}..={}",
                        end - 1
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// This replica group's place in a topology file, announced to the other groups.
#[derive(Debug, Clone)]
pub struct Placement {
    /// The parsed file (the same on every group of a well-configured job).
    pub topology: std::sync::Arc<Topology>,
    /// This group's replica group index (its ranks are `index * world_size + group_rank`).
    pub group: u64,
}

/// The quorum member `data` a manager server of this build announces: the version of its
/// source choice and, with a topology file, its placement in it.
pub fn member_data(placement: Option<&Placement>) -> String {
    let mut data = Map::new();
    data.insert("heal_sources".into(), Value::from(HEAL_SOURCES_VERSION));
    if let Some(p) = placement {
        data.insert(
            "topology".into(),
            serde_json::json!({"group": p.group, "digest": p.topology.digest()}),
        );
    }
    Value::Object(data).to_string()
}

/// What a member announced in its `data` (nothing, for upstream and older managers).
#[derive(Debug, Default)]
struct Announcement {
    /// The `heal_sources` version, when announced.
    heal_sources: Option<u64>,
    /// (replica group index, topology digest), when announced.
    placement: Option<(u64, String)>,
}

fn announced(member: &QuorumMember) -> Announcement {
    if member.data.is_empty() {
        return Announcement::default();
    }
    let Ok(v) = serde_json::from_str::<Value>(&member.data) else {
        return Announcement::default();
    };
    let placement = v.get("topology").and_then(|t| {
        Some((
            t.get("group")?.as_u64()?,
            t.get("digest")?.as_str()?.to_string(),
        ))
    });
    Announcement {
        heal_sources: v.get("heal_sources").and_then(Value::as_u64),
        placement,
    }
}

/// How the sources of one quorum are chosen; every group of the quorum reaches the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceChoice {
    /// Every member announced the same topology file (and distinct group indices).
    TopologyFile,
    /// Every member announced a `heal_sources` version: same host is better connected.
    Hosts,
    /// Some member announced no `heal_sources` version (an older or upstream manager): plain
    /// round-robin, as that member computes it.
    RoundRobin,
}

/// Which way `participants` choose their sources, given this group's topology file.
pub fn source_choice(participants: &[&QuorumMember], topology: Option<&Topology>) -> SourceChoice {
    match locality(participants, topology, 0) {
        Some(Locality::File { .. }) => SourceChoice::TopologyFile,
        Some(Locality::Hosts(_)) => SourceChoice::Hosts,
        None => SourceChoice::RoundRobin,
    }
}

/// The host part of a manager address (`http://host:port`, `https://[::1]:port`).
pub fn address_host(address: &str) -> &str {
    let rest = address.split_once("://").map_or(address, |(_, r)| r);
    let rest = rest.split('/').next().unwrap_or(rest);
    if let Some(v6) = rest.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    rest.rsplit_once(':').map_or(rest, |(h, _)| h)
}

/// How well a source is connected to a healer, as a transfer-time model.
#[derive(Debug, Clone, Copy)]
struct Connection {
    latency_s: f64,
    /// Bytes per second (relative units in host mode); 0 = not connected (worst).
    bandwidth: f64,
}

/// Locality of the members of one quorum, as seen by group rank `group_rank`.
enum Locality<'a> {
    Hosts(Vec<&'a str>),
    File {
        topology: &'a Topology,
        groups: Vec<u64>,
        world_size: u64,
        group_rank: u64,
    },
}

/// The locality `participants` agree on (see [`SourceChoice`]); None for plain round-robin.
fn locality<'a>(
    participants: &[&'a QuorumMember],
    topology: Option<&'a Topology>,
    group_rank: u64,
) -> Option<Locality<'a>> {
    let announcements: Vec<Announcement> = participants.iter().map(|p| announced(p)).collect();
    if let Some(topology) = topology {
        let groups: Option<Vec<u64>> = announcements
            .iter()
            .map(|a| match &a.placement {
                Some((g, digest)) if digest == topology.digest() => Some(*g),
                _ => None,
            })
            .collect();
        if let (Some(groups), Some(first)) = (groups, participants.first()) {
            let distinct: BTreeSet<u64> = groups.iter().copied().collect();
            if distinct.len() == groups.len() {
                return Some(Locality::File {
                    topology,
                    groups,
                    world_size: first.world_size,
                    group_rank,
                });
            }
        }
    }
    announcements
        .iter()
        .all(|a| a.heal_sources.is_some_and(|v| v >= 1))
        .then(|| {
            Locality::Hosts(
                participants
                    .iter()
                    .map(|p| address_host(&p.address))
                    .collect(),
            )
        })
}

impl Locality<'_> {
    fn connection(&self, dst: usize, src: usize) -> Connection {
        match self {
            Locality::Hosts(hosts) => Connection {
                latency_s: 0.0,
                bandwidth: if hosts[dst] == hosts[src] {
                    SAME_HOST_BANDWIDTH
                } else {
                    OTHER_HOST_BANDWIDTH
                },
            },
            Locality::File {
                topology,
                groups,
                world_size,
                group_rank,
            } => {
                // Group indices come from the other members: out-of-range ones (overflow)
                // simply have no connection.
                let rank = |i: usize| {
                    groups[i]
                        .checked_mul(*world_size)
                        .and_then(|r| r.checked_add(*group_rank))
                };
                match rank(dst)
                    .zip(rank(src))
                    .and_then(|(d, s)| topology.link(d, s))
                {
                    Some(l) => Connection {
                        latency_s: l.latency_s.unwrap_or(0.0),
                        bandwidth: l.bandwidth_bps.unwrap_or(topology.default_bandwidth_bps),
                    },
                    None => Connection {
                        latency_s: 0.0,
                        bandwidth: 0.0,
                    },
                }
            }
        }
    }
}

/// Chooses a source for every destination.
///
/// `participants` are the quorum's members in replica-rank order; `sources` and
/// `destinations` are replica ranks. Returns, parallel to `destinations`, the source each
/// heals from. Greedy, in destination order: each healer takes the source with the smallest
/// modelled transfer time — latency plus (healers already on that source + 1) × 1 GB over the
/// connection's bandwidth — so a much better connected source is shared while equally
/// connected sources are spread. Ties go to fewer healers, then round-robin offset by
/// `group_rank` (so with no locality information this is exactly round-robin, and the ranks
/// of one group do not all pull from the same source). Deterministic: every group computes the
/// same answer from the same quorum: the topology file applies only when every member
/// announced the same digest, host names only when every member announced a `heal_sources`
/// version, and otherwise (an older or upstream manager in the quorum) the assignment is
/// exactly that manager's round-robin, `sources[(k + group_rank) % n]` for the k-th healer.
pub fn assign_sources(
    participants: &[&QuorumMember],
    sources: &[usize],
    destinations: &[usize],
    group_rank: u64,
    topology: Option<&Topology>,
) -> Vec<usize> {
    if sources.is_empty() {
        return Vec::new();
    }
    let n = sources.len();
    let offset = (group_rank % n as u64) as usize;
    let Some(locality) = locality(participants, topology, group_rank) else {
        // An older or upstream manager is in the quorum: choose exactly as it does.
        return (0..destinations.len())
            .map(|k| sources[(k + offset) % n])
            .collect();
    };
    let mut load = vec![0u64; n];
    let mut chosen = Vec::with_capacity(destinations.len());
    for (k, &dst) in destinations.iter().enumerate() {
        let start = (k + offset) % n;
        let mut best: Option<(f64, u64, usize, usize)> = None;
        for (j, &src) in sources.iter().enumerate() {
            let c = locality.connection(dst, src);
            let cost = if c.bandwidth > 0.0 {
                c.latency_s + (load[j] + 1) as f64 * NOMINAL_HEAL_BYTES / c.bandwidth
            } else {
                f64::INFINITY
            };
            let rotation = (j + n - start) % n;
            let key = (cost, load[j], rotation, j);
            let better = match best {
                None => true,
                Some(b) => {
                    key.0
                        .total_cmp(&b.0)
                        .then(key.1.cmp(&b.1))
                        .then(key.2.cmp(&b.2))
                        == std::cmp::Ordering::Less
                }
            };
            if better {
                best = Some(key);
            }
        }
        // `sources` is not empty, so a best exists.
        let j = best.map_or(start, |b| b.3);
        load[j] += 1;
        chosen.push(sources[j]);
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(latency_us: &str, gbps: &str, channels: &str) -> Value {
        serde_json::json!({"connection": {
            "latency": {"value": latency_us, "measurement": "us"},
            "bandwidth": {"value": gbps, "measurement": "GB/s"},
            "channels": {"value": channels}
        }})
    }

    /// The seed's example: ranks 0 and 1 on NVLink, rank 2 over IB.
    fn seed_example() -> String {
        serde_json::json!({
            "version": "0.1",
            "ranks": {
                "0": {"peers": {"1": conn("22", "64", "4"), "2": conn("600", "0.4", "4")}},
                "1": {"peers": {"0": conn("22", "64", "4"), "2": conn("600", "0.4", "4")}},
                "2": {"peers": {"0": conn("600", "0.4", "4"), "1": conn("600", "0.4", "4")}}
            }
        })
        .to_string()
    }

    #[test]
    fn parses_the_seed_example_with_units() {
        let t = Topology::parse(&seed_example()).unwrap();
        let l = t.link(0, 1).unwrap();
        assert_eq!(l.bandwidth_bps, Some(64e9));
        assert!((l.latency_s.unwrap() - 22e-6).abs() < 1e-12);
        assert_eq!(l.channels, Some(4));
        assert_eq!(t.link(2, 0).unwrap().bandwidth_bps, Some(0.4e9));
        assert!(t.has_rank(2) && !t.has_rank(3));
        assert_eq!(t.digest().len(), 16);
        t.check_group(0, 3).unwrap();
        assert!(t.check_group(1, 3).is_err());
    }

    #[test]
    fn a_link_listed_one_way_serves_both_directions() {
        let text = r#"{"version": "0.1", "ranks": {"0": {"peers": {"1": {"connection":
            {"bandwidth": {"value": 8, "measurement": "Gb/s"}}}}}, "1": {}}}"#;
        let t = Topology::parse(text).unwrap();
        assert_eq!(t.link(1, 0).unwrap().bandwidth_bps, Some(1e9));
        assert_eq!(t.link(0, 1).unwrap().bandwidth_bps, Some(1e9));
    }

    #[test]
    fn digest_follows_content_not_layout() {
        let a = Topology::parse(&seed_example()).unwrap();
        let pretty =
            serde_json::to_string_pretty(&serde_json::from_str::<Value>(&seed_example()).unwrap())
                .unwrap();
        let b = Topology::parse(&pretty).unwrap();
        assert_eq!(a.digest(), b.digest());
        let c = Topology::parse(&seed_example().replace("\"64\"", "\"65\"")).unwrap();
        assert_ne!(a.digest(), c.digest());
    }

    #[test]
    fn bad_files_name_the_field() {
        let cases: &[(&str, &str)] = &[
            ("not json", "not valid JSON"),
            ("[]", "(top level)"),
            (r#"{"ranks": {}}"#, "field version: missing"),
            (r#"{"version": "0.2", "ranks": {"0": {}}}"#, "field version"),
            (r#"{"version": 0.1, "ranks": {"0": {}}}"#, "field version"),
            (r#"{"version": "0.1"}"#, "field ranks: missing"),
            (
                r#"{"version": "0.1", "ranks": []}"#,
                "field ranks: must be an object",
            ),
            (r#"{"version": "0.1", "ranks": {}}"#, "at least one rank"),
            (r#"{"version": "0.1", "ranks": {"x": {}}}"#, "rank keys"),
            (
                r#"{"version": "0.1", "ranks": {"0": {"peers": {"0": {}}}}}"#,
                "field ranks.\"0\".peers.\"0\": a rank must not list itself",
            ),
            (
                r#"{"version": "0.1", "ranks": {"0": {"peers": {"1": {"connection":
                    {"bandwidth": {"value": "fast"}}}}}}}"#,
                "field ranks.\"0\".peers.\"1\".connection.bandwidth.value",
            ),
            (
                r#"{"version": "0.1", "ranks": {"0": {"peers": {"1": {"connection":
                    {"bandwidth": {"value": "1", "measurement": "furlongs"}}}}}}}"#,
                "field ranks.\"0\".peers.\"1\".connection.bandwidth.measurement: unknown unit",
            ),
            (
                r#"{"version": "0.1", "ranks": {"0": {"peers": {"1": {"connection":
                    {"latency": {"measurement": "us"}}}}}}}"#,
                "field ranks.\"0\".peers.\"1\".connection.latency.value: missing",
            ),
            (
                r#"{"version": "0.1", "ranks": {"0": {"peers": {"1": {"connection":
                    {"latency": {"value": "-3"}}}}}}}"#,
                "connection.latency.value: must be a non-negative number",
            ),
            (
                r#"{"version": "0.1", "ranks": {"0": {"peers": {"1": {"connection":
                    {"channels": {"value": "2.5"}}}}}}}"#,
                "connection.channels.value: must be a whole number",
            ),
            (
                r#"{"version": "0.1", "ranks": {"0": {"peers": {"1": {"connection":
                    {"bandwidth": {"value": 0}}}}}}}"#,
                "connection.bandwidth.value: must be > 0",
            ),
            (
                r#"{"version": "0.1", "ranks": {"0": {"peers": {"1": {"connection": 5}}}}}"#,
                "connection: must be an object",
            ),
        ];
        for (text, want) in cases {
            let err = Topology::parse(text).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{text}: {err}");
            assert!(
                err.to_string().contains(want),
                "{text}: {err} lacks {want:?}"
            );
        }
    }

    #[test]
    fn out_of_range_values_and_group_indices_are_errors() {
        let text = r#"{"version": "0.1", "ranks": {"0": {"peers": {"1": {"connection":
            {"bandwidth": {"value": "1e300", "measurement": "TB/s"}}}}}}}"#;
        let err = Topology::parse(text).unwrap_err().to_string();
        assert!(
            err.contains("connection.bandwidth.value") && err.contains("out of range"),
            "{err}"
        );
        let t = pairs();
        // (u64::MAX / 2) * 2 fits, adding the world size does not.
        let err = t.check_group(u64::MAX / 2, 2).unwrap_err().to_string();
        assert!(err.contains("too large"), "{err}");
        assert!(t.check_group(u64::MAX, 2).is_err());
        assert!(t.check_group(1, 2).is_ok());
    }

    #[test]
    fn load_names_the_file() {
        let dir = std::env::temp_dir().join(format!("torchft-topo-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("topo.json");
        std::fs::write(&path, r#"{"version": "9"}"#).unwrap();
        let err = Topology::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("topo.json") && err.contains("field version"),
            "{err}"
        );
        let missing = Topology::load(&dir.join("nope.json"))
            .unwrap_err()
            .to_string();
        assert!(missing.contains("nope.json") && missing.contains("cannot be read"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn address_host_handles_names_ports_and_ipv6() {
        assert_eq!(address_host("http://node-3:29500"), "node-3");
        assert_eq!(address_host("https://[::1]:443"), "::1");
        assert_eq!(address_host("10.0.0.1:5"), "10.0.0.1");
        assert_eq!(address_host("http://h"), "h");
    }

    fn member(id: &str, host: &str, data: String) -> QuorumMember {
        QuorumMember {
            data,
            ..crate::testkit::member_on(id, host, 0)
        }
    }

    fn placed(t: &Topology, group: u64) -> String {
        member_data(Some(&Placement {
            topology: std::sync::Arc::new(t.clone()),
            group,
        }))
    }

    /// What a manager of this build without a topology file announces.
    fn plain() -> String {
        member_data(None)
    }

    /// Groups "a", "b", … on these hosts, each announcing this build without a topology file.
    fn on_hosts(hosts: &[&str]) -> Vec<QuorumMember> {
        ('a'..)
            .zip(hosts)
            .map(|(id, host)| member(&id.to_string(), host, plain()))
            .collect()
    }

    /// Groups "g0" … "g{n-1}" on one host, group i placed as index i of `t`.
    fn placed_groups(t: &Topology, n: u64) -> Vec<QuorumMember> {
        (0..n)
            .map(|i| member(&format!("g{i}"), "h", placed(t, i)))
            .collect()
    }

    fn ps_of(ms: &[QuorumMember]) -> Vec<&QuorumMember> {
        ms.iter().collect()
    }

    /// Four ranks: 0–1 fast to each other, 2–3 fast to each other, slow across.
    fn pairs() -> Topology {
        let fast = || conn("5", "100", "8");
        let slow = || conn("500", "1", "1");
        Topology::parse(
            &serde_json::json!({"version": "0.1", "ranks": {
                "0": {"peers": {"1": fast(), "2": slow(), "3": slow()}},
                "1": {"peers": {"0": fast(), "2": slow(), "3": slow()}},
                "2": {"peers": {"0": slow(), "1": slow(), "3": fast()}},
                "3": {"peers": {"0": slow(), "1": slow(), "2": fast()}}
            }})
            .to_string(),
        )
        .unwrap()
    }

    #[test]
    fn without_locality_healers_are_spread_round_robin() {
        let ms: Vec<QuorumMember> = ["a", "b", "c", "d", "e"]
            .iter()
            .map(|id| member(id, "h", String::new()))
            .collect();
        let ps = ps_of(&ms);
        assert_eq!(assign_sources(&ps, &[1, 3], &[0, 2, 4], 0, None), [1, 3, 1]);
        assert_eq!(assign_sources(&ps, &[1, 3], &[0, 2, 4], 1, None), [3, 1, 3]);
        assert!(assign_sources(&ps, &[], &[0], 0, None).is_empty());
    }

    #[test]
    fn same_host_source_is_preferred() {
        // Sources a (host x), b (host y); healers c (host y), d (host x): round-robin would
        // give c → a and d → b, locality gives the reverse.
        let ms = on_hosts(&["x", "y", "y", "x"]);
        assert_eq!(
            assign_sources(&ps_of(&ms), &[0, 1], &[2, 3], 0, None),
            [1, 0]
        );
        // Both healers on host y: the local source is shared (ten times better connected).
        let ms = on_hosts(&["x", "y", "y", "y"]);
        assert_eq!(
            assign_sources(&ps_of(&ms), &[0, 1], &[2, 3], 0, None),
            [1, 1]
        );
    }

    #[test]
    fn topology_file_picks_the_best_connected_source() {
        let t = pairs();
        // All on one host. a, b, c, d are replica groups 0, 2, 3, 1 (one rank each): sources
        // a (rank 0) and b (rank 2); healers c (rank 3, fast to b) and d (rank 1, fast to a).
        let ms: Vec<QuorumMember> = ["a", "b", "c", "d"]
            .iter()
            .zip([0u64, 2, 3, 1])
            .map(|(id, g)| member(id, "h", placed(&t, g)))
            .collect();
        let ps = ps_of(&ms);
        assert_eq!(assign_sources(&ps, &[0, 1], &[2, 3], 0, Some(&t)), [1, 0]);
        // Without the file the same quorum is round-robin: c → a, d → b.
        assert_eq!(assign_sources(&ps, &[0, 1], &[2, 3], 0, None), [0, 1]);
    }

    #[test]
    fn group_ranks_use_their_own_job_wide_ranks() {
        // Two ranks per group: rank r of group g is job-wide rank 2g + r. Job-wide 2 (g1's
        // rank 0) is fast to 4 (g2's rank 0); job-wide 1 (g0's rank 1) is fast to 3 (g1's
        // rank 1); nothing else is listed.
        let t = Topology::parse(
            &serde_json::json!({"version": "0.1", "ranks": {
                "0": {}, "1": {"peers": {"3": conn("5", "100", "8")}},
                "2": {"peers": {"4": conn("5", "100", "8")}}, "3": {}, "4": {}, "5": {}
            }})
            .to_string(),
        )
        .unwrap();
        let mut ms = placed_groups(&t, 3);
        for m in &mut ms {
            m.world_size = 2;
        }
        let ps = ps_of(&ms);
        // Sources g0, g1; healer g2. Group rank 0: job-wide 4 is fast to 2 (g1).
        assert_eq!(assign_sources(&ps, &[0, 1], &[2], 0, Some(&t)), [1]);
        // Group rank 1, healer g1 of sources g0 and g2: job-wide 3 is fast to 1 (g0), while
        // round-robin (offset 1) would pick g2.
        assert_eq!(assign_sources(&ps, &[0, 2], &[1], 1, Some(&t)), [0]);
        assert_eq!(assign_sources(&ps, &[0, 2], &[1], 1, None), [2]);
    }

    #[test]
    fn a_much_better_source_is_shared_an_equal_one_spreads() {
        let t = pairs();
        // Sources: rank 0 and rank 2; healers ranks 1 and 3 → each to its fast partner.
        let ms = placed_groups(&t, 4);
        let ps = ps_of(&ms);
        assert_eq!(assign_sources(&ps, &[0, 2], &[1, 3], 0, Some(&t)), [0, 2]);
        // Sources 0 and 1 (both fast to each other, slow to 2 and 3): healers 2 and 3 see
        // both sources equally slow, so they spread.
        assert_eq!(assign_sources(&ps, &[0, 1], &[2, 3], 0, Some(&t)), [0, 1]);
        // Sources 2 and 3, healers 0 and 1: equal as well: spread.
        let got = assign_sources(&ps, &[2, 3], &[0, 1], 0, Some(&t));
        assert_ne!(got[0], got[1]);
        // Source 0 and 2, healers 1 only and three copies... a healer fast to 0 (rank 1)
        // still goes to 0 even though 0 already serves another fast-linked healer, because
        // sharing a 100 GB/s link beats a 1 GB/s one.
        let t3 = Topology::parse(
            &serde_json::json!({"version": "0.1", "ranks": {
                "0": {"peers": {"1": conn("5", "100", "8"), "3": conn("5", "100", "8")}},
                "1": {}, "2": {"peers": {"1": conn("500", "1", "1"),
                                           "3": conn("500", "1", "1")}}, "3": {}
            }})
            .to_string(),
        )
        .unwrap();
        let ms3 = placed_groups(&t3, 4);
        assert_eq!(
            assign_sources(&ps_of(&ms3), &[0, 2], &[1, 3], 0, Some(&t3)),
            [0, 0]
        );
    }

    #[test]
    fn disagreeing_or_missing_announcements_do_not_use_the_file() {
        let t = pairs();
        let other = Topology::parse(&seed_example()).unwrap();
        // As in topology_file_picks_the_best_connected_source: the file gives [1, 0], hosts
        // (all one host) give round-robin [0, 1].
        let mut ms: Vec<QuorumMember> = ["a", "b", "c", "d"]
            .iter()
            .zip([0u64, 2, 3, 1])
            .map(|(id, g)| member(id, "h", placed(&t, g)))
            .collect();
        let assign =
            |ms: &[QuorumMember]| assign_sources(&ps_of(ms), &[0, 1], &[2, 3], 0, Some(&t));
        let choice = |ms: &[QuorumMember]| source_choice(&ps_of(ms), Some(&t));
        assert_eq!(assign(&ms), [1, 0]);
        assert_eq!(choice(&ms), SourceChoice::TopologyFile);
        // Member d announces another file.
        ms[3].data = placed(&other, 1);
        assert_eq!(assign(&ms), [0, 1]);
        assert_eq!(choice(&ms), SourceChoice::Hosts);
        // A member of this build without a file.
        ms[3].data = plain();
        assert_eq!(assign(&ms), [0, 1]);
        assert_eq!(choice(&ms), SourceChoice::Hosts);
        // A member with no announcement (an upstream manager), or garbage: round-robin.
        ms[3].data = String::new();
        assert_eq!(assign(&ms), [0, 1]);
        assert_eq!(choice(&ms), SourceChoice::RoundRobin);
        ms[3].data = "{not json".into();
        assert_eq!(assign(&ms), [0, 1]);
        assert_eq!(choice(&ms), SourceChoice::RoundRobin);
        // Two members claiming the same group index: ambiguous.
        ms[3].data = placed(&t, 3);
        assert_eq!(assign(&ms), [0, 1]);
        assert_eq!(choice(&ms), SourceChoice::Hosts);
        // This group has no file while the others do.
        ms[3].data = placed(&t, 1);
        assert_eq!(
            assign_sources(&ps_of(&ms), &[0, 1], &[2, 3], 0, None),
            [0, 1]
        );
        assert_eq!(source_choice(&ps_of(&ms), None), SourceChoice::Hosts);
    }

    /// The k-th healer heals from `sources[(k + group_rank) % n]`: how managers that announce
    /// no `heal_sources` version (older builds, upstream torchft) assign sources.
    fn legacy_round_robin(
        sources: &[usize],
        destinations: &[usize],
        group_rank: u64,
    ) -> Vec<usize> {
        (0..destinations.len())
            .map(|k| sources[(k + group_rank as usize) % sources.len()])
            .collect()
    }

    #[test]
    fn a_member_without_the_marker_makes_everyone_round_robin() {
        // Sources a, b on hosts x, y; healers c, d, e on hosts y, y, x. With every member
        // announcing the marker, locality sends c and d to b and e to a.
        let mut ms = on_hosts(&["x", "y", "y", "y", "x"]);
        let (sources, dests) = ([0, 1], [2, 3, 4]);
        assert_eq!(
            assign_sources(&ps_of(&ms), &sources, &dests, 0, None),
            [1, 1, 0]
        );
        assert_ne!(
            assign_sources(&ps_of(&ms), &sources, &dests, 0, None),
            legacy_round_robin(&sources, &dests, 0)
        );
        // One member (a healer, then a source) of an older or upstream build: every group
        // rank's assignment is exactly the legacy one, with or without a topology file.
        let t = pairs();
        for odd in [2, 0] {
            ms[odd].data = String::new();
            for group_rank in 0..4 {
                let want = legacy_round_robin(&sources, &dests, group_rank);
                assert_eq!(
                    assign_sources(&ps_of(&ms), &sources, &dests, group_rank, None),
                    want
                );
                assert_eq!(
                    assign_sources(&ps_of(&ms), &sources, &dests, group_rank, Some(&t)),
                    want
                );
            }
            ms[odd].data = plain();
        }
        // A marker that is not a version (garbage from some other writer of `data`) counts
        // as no marker.
        ms[4].data = r#"{"heal_sources": "yes"}"#.into();
        assert_eq!(
            assign_sources(&ps_of(&ms), &sources, &dests, 1, None),
            legacy_round_robin(&sources, &dests, 1)
        );
    }

    #[test]
    fn member_data_always_announces_the_version() {
        let v: Value = serde_json::from_str(&plain()).unwrap();
        assert_eq!(v, serde_json::json!({"heal_sources": HEAL_SOURCES_VERSION}));
        let t = pairs();
        let v: Value = serde_json::from_str(&placed(&t, 3)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"heal_sources": HEAL_SOURCES_VERSION,
                               "topology": {"group": 3, "digest": t.digest()}})
        );
        // The lighthouse accepts it, and a step later it is the same (so the compact quorum
        // path still sends only the steps).
        let announce: [&dyn Fn() -> String; 2] = [&plain, &|| placed(&t, 3)];
        for data in announce {
            let a = member("a", "h", data());
            crate::testkit::lighthouse_accepts(&a).unwrap();
            let b = QuorumMember {
                step: a.step + 1,
                ..member("a", "h", data())
            };
            assert!(crate::client::compact::same_except_step(&a, &b));
        }
    }

    #[test]
    fn huge_announced_group_indices_do_not_overflow() {
        let t = pairs();
        let mut ms: Vec<QuorumMember> = (0..4)
            .map(|i| member(&format!("g{i}"), "h", placed(&t, i)))
            .collect();
        for m in &mut ms {
            m.world_size = 2;
        }
        ms[3].data = placed(&t, u64::MAX);
        // g3's ranks overflow: it has no connection, so it takes the sources round-robin.
        assert_eq!(
            assign_sources(&ps_of(&ms), &[0, 1], &[2, 3], 1, Some(&t)).len(),
            2
        );
    }

    #[test]
    fn unlisted_links_are_worst_but_still_spread() {
        let t =
            Topology::parse(r#"{"version": "0.1", "ranks": {"0": {}, "1": {}, "2": {}, "3": {}}}"#)
                .unwrap();
        let ms = placed_groups(&t, 4);
        let ps = ps_of(&ms);
        assert_eq!(assign_sources(&ps, &[0, 1], &[2, 3], 0, Some(&t)), [0, 1]);
    }
}
