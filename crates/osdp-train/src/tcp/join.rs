//! The rendezvous of a multi-process run, which trusts no one who reaches the port: rank 0
//! listens only on `MASTER_ADDR`; a rank's hello carries the run token (`OSDP_RUN_TOKEN`) and
//! the run's [`Terms`]. Rank 0 drops a connection with the wrong token, with no whole hello in
//! time, with garbage or with an oversized hello, and keeps waiting for the real ranks, reading
//! every connection at once; a rank whose terms differ (another model, plan, seed, learning
//! rate…) ends the join on every rank with a message naming the field. Rank 0 answers only when
//! every rank has joined, so a rank starts training only in a complete, agreed group.

use std::collections::{BTreeMap, VecDeque};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::env::{self, OSDP_RUN_TOKEN};

const MAGIC: u32 = 0x05D9_7C01;
/// Version of the join handshake: a rank of a build that speaks another is refused by name.
const PROTOCOL: u32 = 2;
/// Bytes of a hello before its token and terms: magic, protocol, rank, world, two lengths.
const HELLO_HEAD: usize = 24;
/// Longest run token.
const MAX_TOKEN_BYTES: usize = 1024;
/// Largest terms a hello may carry (a few dozen short fields take about 1 KiB).
const MAX_TERMS_BYTES: usize = 64 << 10;
/// Longest message in rank 0's answer.
const MAX_ANSWER_BYTES: usize = 4096;
/// How long a connection may take to send its whole hello before rank 0 drops it.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections at once that have not finished their hello; a newer one pushes out the oldest.
const MAX_PENDING: usize = 64;
/// How long a rank waits for rank 0's answer beyond the join timeout: rank 0 was listening
/// before the rank connected, so its own deadline passes within the join timeout.
const ANSWER_GRACE: Duration = Duration::from_secs(5);

/// The secret every rank of a run presents when it joins (`OSDP_RUN_TOKEN`; empty when unset,
/// which any process that reaches the port then matches). Never printed.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RunToken(String);

impl RunToken {
    pub fn new(token: impl Into<String>) -> RunToken {
        RunToken(token.into())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `presented` is this token, in time that does not depend on where they differ.
    fn matches(&self, presented: &[u8]) -> bool {
        let ours = self.0.as_bytes();
        ours.len() == presented.len()
            && ours
                .iter()
                .zip(presented)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl std::fmt::Debug for RunToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_empty() {
            "RunToken(none)"
        } else {
            "RunToken(…)"
        })
    }
}

/// This process's rank and how to reach the others, from the torchrun/Slurm environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    pub rank: usize,
    pub world: usize,
    /// `MASTER_ADDR:MASTER_PORT`: where rank 0 listens (and binds: nowhere else).
    pub master: String,
    pub join_timeout: Duration,
    pub token: RunToken,
}

impl Membership {
    /// `RANK`, `WORLD_SIZE` (or Slurm's `SLURM_PROCID`, `SLURM_NTASKS`), `MASTER_ADDR`
    /// (default 127.0.0.1), `MASTER_PORT` (default 29500), `OSDP_JOIN_TIMEOUT_S` (default 120)
    /// and `OSDP_RUN_TOKEN`. `None` when `WORLD_SIZE` is not set.
    ///
    /// Under torchrun (`TORCHELASTIC_RUN_ID` set) its own store already listens on
    /// `MASTER_PORT`, so the group uses the next port; `OSDP_PORT` overrides either.
    pub fn from_env() -> Result<Option<Membership>, String> {
        Membership::from_vars(env::launcher_var)
    }

    /// [`Membership::from_env`] over any source of variables.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Membership>, String> {
        // torchrun's names first, Slurm's as the fallback (`srun osdp-tui train …`).
        let Some(world) = var(env::WORLD_SIZE).or_else(|| var(env::SLURM_NTASKS)) else {
            return Ok(None);
        };
        let num = |k: &str, v: &str| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| format!("{k}={v:?} is not a number"))
        };
        let world = num(env::WORLD_SIZE, &world)?;
        let rank = num(
            env::RANK,
            &var(env::RANK)
                .or_else(|| var(env::SLURM_PROCID))
                .ok_or("WORLD_SIZE is set but RANK is not")?,
        )?;
        if world == 0 || rank >= world {
            return Err(format!("RANK {rank} is not below WORLD_SIZE {world}"));
        }
        let addr = var(env::MASTER_ADDR).unwrap_or_else(|| "127.0.0.1".into());
        let master_port = num(
            env::MASTER_PORT,
            &var(env::MASTER_PORT).unwrap_or_else(|| "29500".into()),
        )?;
        let port = match (var(env::OSDP_PORT), var(env::TORCHELASTIC_RUN_ID)) {
            (Some(p), _) => num(env::OSDP_PORT, &p)?,
            (None, Some(_)) => master_port + 1,
            (None, None) => master_port,
        };
        if port > usize::from(u16::MAX) {
            return Err(format!("port {port} is not a TCP port (at most 65535)"));
        }
        let timeout = match var(env::OSDP_JOIN_TIMEOUT_S) {
            Some(v) => num(env::OSDP_JOIN_TIMEOUT_S, &v)?.min(24 * 3600) as u64,
            None => 120,
        };
        let token = var(OSDP_RUN_TOKEN).unwrap_or_default();
        if token.len() > MAX_TOKEN_BYTES {
            return Err(format!(
                "{OSDP_RUN_TOKEN} is {} bytes long (at most {MAX_TOKEN_BYTES})",
                token.len()
            ));
        }
        Ok(Some(Membership {
            rank,
            world,
            master: format!("{addr}:{port}"),
            join_timeout: Duration::from_secs(timeout),
            token: RunToken(token),
        }))
    }

    /// A warning worth printing before the join: rank 0 listens beyond this machine and no
    /// token keeps strangers out.
    pub fn exposure(&self) -> Option<String> {
        let host = self.master.rsplit_once(':').map_or("", |(h, _)| h);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let loopback = host == "localhost"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback());
        (self.rank == 0 && self.token.is_empty() && !loopback).then(|| {
            format!(
                "note: rank 0 listens on {} and OSDP_RUN_TOKEN is not set: any process that \
                 reaches the port may join (set the same OSDP_RUN_TOKEN on every rank)",
                self.master
            )
        })
    }
}

/// What every rank of a run must agree on before a tensor moves — model, plan, world size,
/// hyper-parameters — as named values in a fixed order. Rank 0 compares each rank's with its
/// own and names the first field that differs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Terms(Vec<(String, String)>);

impl Terms {
    /// These terms and `field` = `value`.
    pub fn with(mut self, field: &str, value: impl std::fmt::Display) -> Terms {
        self.0.push((field.to_string(), value.to_string()));
        self
    }

    fn get(&self, field: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(f, _)| f == field)
            .map(|(_, v)| v.as_str())
    }

    /// Why rank `rank`, with `theirs`, cannot run with rank 0, with these: the first field
    /// that differs, as "rank 2 has lr 0.001, rank 0 has 0.0003". `None` when they agree.
    pub fn disagreement(&self, rank: usize, theirs: &Terms) -> Option<String> {
        for (field, ours) in &self.0 {
            match theirs.get(field) {
                Some(v) if v == ours => {}
                Some(v) => {
                    return Some(format!(
                        "rank {rank} has {field} {}, rank 0 has {ours}",
                        shown(v)
                    ))
                }
                None => {
                    return Some(format!(
                        "rank {rank} states no {field} (rank 0 has {ours}): it runs another \
                         version of osdp-tui"
                    ))
                }
            }
        }
        theirs
            .0
            .iter()
            .find(|(f, _)| self.get(f).is_none())
            .map(|(f, v)| {
                format!(
                    "rank {rank} has {} {}, which rank 0 does not know: it runs another version \
                     of osdp-tui",
                    shown(f),
                    shown(v)
                )
            })
    }
}

/// A value another process sent, as it may be printed: no control characters, not too long.
fn shown(v: &str) -> String {
    const MOST: usize = 120;
    let v = osdp_core::text::printable(v);
    match v.char_indices().nth(MOST) {
        Some((cut, _)) => format!("{}…", &v[..cut]),
        None => v.into_owned(),
    }
}

/// A complete hello: who the process says it is and the terms it runs under.
struct Hello {
    rank: usize,
    world: usize,
    terms: Terms,
}

/// Why rank 0 turned a connection away (counted for the message should the join fail), and
/// what it tells the other end, if anything.
struct Rejection {
    why: &'static str,
    tell: Option<String>,
}

impl Rejection {
    fn silent(why: &'static str) -> Rejection {
        Rejection { why, tell: None }
    }
}

/// How far a hello in `buf` has come.
enum Examined {
    /// Wait for this many bytes in all.
    Need(usize),
    Complete(Hello),
    Reject(Rejection),
}

fn u32_at(buf: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]])
}

/// Read a hello as far as `buf` goes, checking each part as soon as it has arrived: the magic
/// before anything else, the announced sizes before reading what they announce, the token
/// before the terms.
fn examine(buf: &[u8], token: &RunToken) -> Examined {
    if buf.len() >= 4 && u32_at(buf, 0) != MAGIC {
        return Examined::Reject(Rejection::silent("sent something other than a hello"));
    }
    if buf.len() < HELLO_HEAD {
        return Examined::Need(HELLO_HEAD);
    }
    let protocol = u32_at(buf, 4);
    if protocol != PROTOCOL {
        return Examined::Reject(Rejection {
            why: "spoke another version of the handshake",
            tell: Some(format!(
                "rank 0 speaks join protocol {PROTOCOL}, this process {protocol}: run the same \
                 osdp-tui on every rank"
            )),
        });
    }
    let (rank, world) = (u32_at(buf, 8) as usize, u32_at(buf, 12) as usize);
    let (token_len, terms_len) = (u32_at(buf, 16) as usize, u32_at(buf, 20) as usize);
    if token_len > MAX_TOKEN_BYTES || terms_len > MAX_TERMS_BYTES {
        return Examined::Reject(Rejection::silent("announced an oversized hello"));
    }
    let token_end = HELLO_HEAD + token_len;
    if buf.len() < token_end {
        return Examined::Need(token_end);
    }
    if !token.matches(&buf[HELLO_HEAD..token_end]) {
        return Examined::Reject(Rejection {
            why: "presented a wrong run token",
            tell: Some(
                "rank 0 refused this process: its run token (OSDP_RUN_TOKEN) is not this run's"
                    .into(),
            ),
        });
    }
    let end = token_end + terms_len;
    if buf.len() < end {
        return Examined::Need(end);
    }
    match serde_json::from_slice::<Terms>(&buf[token_end..end]) {
        Ok(terms) => Examined::Complete(Hello { rank, world, terms }),
        Err(_) => Examined::Reject(Rejection::silent("sent an unreadable hello")),
    }
}

/// The bytes of rank `rank`'s hello.
pub(super) fn hello_bytes(rank: usize, world: usize, token: &RunToken, terms: &Terms) -> Vec<u8> {
    let terms = serde_json::to_vec(terms).unwrap_or_default();
    let mut out = Vec::with_capacity(HELLO_HEAD + token.0.len() + terms.len());
    for v in [
        MAGIC,
        PROTOCOL,
        rank as u32,
        world as u32,
        token.0.len() as u32,
        terms.len() as u32,
    ] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(token.0.as_bytes());
    out.extend_from_slice(&terms);
    out
}

/// Rank 0's answer to a hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Answer {
    /// Every rank has joined: start.
    Welcome,
    /// Not this process, or not this run: why.
    Refused(String),
}

fn send_answer(mut s: &TcpStream, answer: &Answer) -> std::io::Result<()> {
    let (status, message) = match answer {
        Answer::Welcome => (0u32, ""),
        Answer::Refused(m) => (1, m.as_str()),
    };
    let mut message = message.as_bytes();
    message = &message[..message.len().min(MAX_ANSWER_BYTES)];
    let mut out = Vec::with_capacity(12 + message.len());
    for v in [MAGIC, status, message.len() as u32] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(message);
    s.write_all(&out)
}

/// Fill `buf` from `s`, giving up at `deadline` however slowly the bytes come.
fn read_exact_by(mut s: &TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(std::io::ErrorKind::TimedOut.into())
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Rank 0's answer, read by `deadline`; `None` when what came is not an answer.
pub(super) fn read_answer(s: &TcpStream, deadline: Instant) -> std::io::Result<Option<Answer>> {
    let mut head = [0u8; 12];
    read_exact_by(s, &mut head, deadline)?;
    let (magic, status, len) = (
        u32_at(&head, 0),
        u32_at(&head, 4),
        u32_at(&head, 8) as usize,
    );
    if magic != MAGIC || status > 1 || len > MAX_ANSWER_BYTES {
        return Ok(None);
    }
    let mut message = vec![0u8; len];
    read_exact_by(s, &mut message, deadline)?;
    Ok(Some(match status {
        0 => Answer::Welcome,
        _ => Answer::Refused(shown(&String::from_utf8_lossy(&message))),
    }))
}

/// A connection rank 0 accepted that has not finished its hello.
struct Pending {
    stream: TcpStream,
    buf: Vec<u8>,
    since: Instant,
}

/// Where a pending connection stands after reading what it has sent.
enum Progress {
    /// Still short of a whole hello; whether any bytes came this time.
    Waiting(bool),
    Closed,
    Rejected(Rejection),
    Hello(Hello),
}

impl Pending {
    /// Read what has arrived, never past the end of the hello nor beyond its announced size.
    fn advance(&mut self, token: &RunToken) -> Progress {
        let mut chunk = [0u8; 4096];
        let mut progressed = false;
        loop {
            let need = match examine(&self.buf, token) {
                Examined::Need(n) => n,
                Examined::Complete(hello) => return Progress::Hello(hello),
                Examined::Reject(r) => return Progress::Rejected(r),
            };
            let want = (need - self.buf.len()).min(chunk.len());
            match (&self.stream).read(&mut chunk[..want]) {
                Ok(0) => return Progress::Closed,
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    progressed = true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    return Progress::Waiting(progressed)
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Progress::Closed,
            }
        }
    }
}

/// Connections rank 0 turned away, by reason, for the message should the join fail.
#[derive(Default)]
struct TurnedAway(BTreeMap<&'static str, usize>);

impl TurnedAway {
    fn note(&mut self, why: &'static str) {
        *self.0.entry(why).or_default() += 1;
    }

    /// ` (turned away 3 other connections: 2 presented a wrong run token, 1 …)`, or nothing.
    fn summary(&self) -> String {
        let total: usize = self.0.values().sum();
        if total == 0 {
            return String::new();
        }
        let parts: Vec<String> = self.0.iter().map(|(why, n)| format!("{n} {why}")).collect();
        format!(
            " (turned away {total} other connection{}: {})",
            if total == 1 { "" } else { "s" },
            parts.join(", ")
        )
    }
}

/// Tell every rank that has joined that the run will not start, and why.
fn refuse_all(joined: &[Option<TcpStream>], why: &str) {
    for s in joined.iter().flatten() {
        let _ = send_answer(s, &Answer::Refused(why.to_string()));
    }
}

/// Rank 0: accept connections until every rank has sent a good hello, reading all of them
/// at once, so a stranger that sends nothing or trickles bytes holds up no one.
pub(super) fn gather(m: &Membership, terms: &Terms) -> Result<Vec<TcpStream>, String> {
    let deadline = Instant::now() + m.join_timeout;
    let listener = TcpListener::bind(&m.master)
        .map_err(|e| format!("rank 0 cannot listen on {}: {e}", m.master))?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut lobby = Lobby {
        m,
        terms,
        patience: HELLO_TIMEOUT.min(m.join_timeout),
        pending: VecDeque::new(),
        joined: (1..m.world).map(|_| None).collect(),
        away: TurnedAway::default(),
    };
    while lobby.joined.iter().any(Option::is_none) {
        let now = Instant::now();
        if now >= deadline {
            return Err(lobby.too_late());
        }
        let accepted = lobby.accept(&listener, now)?;
        let read = lobby.read_hellos(now)?;
        if !(accepted || read) {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    lobby.welcome()
}

/// Rank 0's join in progress: the connections still sending their hello, the ranks that have
/// joined, and those turned away.
struct Lobby<'a> {
    m: &'a Membership,
    terms: &'a Terms,
    /// How long a connection may take to send its whole hello.
    patience: Duration,
    pending: VecDeque<Pending>,
    /// Ranks 1.. by rank, once joined.
    joined: Vec<Option<TcpStream>>,
    away: TurnedAway,
}

impl Lobby<'_> {
    /// The join's deadline has passed: tell the ranks that joined, and say who is missing.
    fn too_late(&mut self) -> String {
        let secs = self.m.join_timeout.as_secs();
        for _ in &self.pending {
            self.away.note("were still sending their hello");
        }
        let missing: Vec<String> = self
            .joined
            .iter()
            .enumerate()
            .filter(|(_, p)| p.is_none())
            .map(|(i, _)| (i + 1).to_string())
            .collect();
        let why = format!(
            "rank(s) {} did not join {} within {secs} s{}",
            missing.join(", "),
            self.m.master,
            self.away.summary()
        );
        refuse_all(&self.joined, &format!("the run cannot start: {why}"));
        why
    }

    /// Accept the connections waiting on `listener` as pending; whether there were any.
    fn accept(&mut self, listener: &TcpListener, now: Instant) -> Result<bool, String> {
        let mut busy = false;
        // At most a pending queue's worth per round: a flood of connections cannot keep
        // rank 0 accepting past its deadline.
        for _ in 0..MAX_PENDING {
            match listener.accept() {
                Ok((stream, _)) => {
                    busy = true;
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    if self.pending.len() >= MAX_PENDING {
                        self.pending.pop_front();
                        self.away.note("were pushed out by newer connections");
                    }
                    self.pending.push_back(Pending {
                        stream,
                        buf: Vec::new(),
                        since: now,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                // A connection reset before it was accepted, or a signal: the next one.
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionAborted
                            | std::io::ErrorKind::ConnectionReset
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(format!("rank 0 accepting on {}: {e}", self.m.master)),
            }
        }
        Ok(busy)
    }

    /// Read what each pending connection has sent: drop the slow, the closed and the
    /// rejected, admit each whole hello; whether anything happened.
    fn read_hellos(&mut self, now: Instant) -> Result<bool, String> {
        let mut busy = false;
        let mut i = 0;
        while i < self.pending.len() {
            let p = &mut self.pending[i];
            match p.advance(&self.m.token) {
                Progress::Waiting(progressed) => {
                    busy |= progressed;
                    if now.duration_since(p.since) >= self.patience {
                        self.away.note("sent no whole hello in time");
                        self.pending.remove(i);
                    } else {
                        i += 1;
                    }
                }
                Progress::Closed => {
                    self.away.note("closed the connection before their hello");
                    self.pending.remove(i);
                }
                Progress::Rejected(r) => {
                    if let Some(tell) = &r.tell {
                        let _ = send_answer(&p.stream, &Answer::Refused(tell.clone()));
                    }
                    self.away.note(r.why);
                    self.pending.remove(i);
                }
                Progress::Hello(hello) => {
                    let Some(p) = self.pending.remove(i) else {
                        break;
                    };
                    busy = true;
                    self.admit(hello, p.stream)?;
                }
            }
        }
        Ok(busy)
    }

    /// A whole hello: the rank joins if its terms agree and it claims a rank the run has that
    /// has not joined; terms that differ end the join on every rank.
    fn admit(&mut self, hello: Hello, stream: TcpStream) -> Result<(), String> {
        let m = self.m;
        if let Some(why) = self.terms.disagreement(hello.rank, &hello.terms) {
            let _ = send_answer(
                &stream,
                &Answer::Refused(format!("rank 0 refused this rank: {why}")),
            );
            refuse_all(&self.joined, &format!("the run cannot start: {why}"));
            return Err(format!("the ranks disagree: {why}"));
        }
        let (r, w) = (hello.rank, hello.world);
        if w != m.world || !(1..m.world).contains(&r) {
            let tell = format!(
                "rank 0 refused this process: it says it is rank {r} of {w}, \
                 the run has ranks 1 to {} besides rank 0",
                m.world - 1
            );
            let _ = send_answer(&stream, &Answer::Refused(tell));
            self.away.note("claimed a rank the run does not have");
        } else if self.joined[r - 1].is_some() {
            let tell = format!("rank 0 refused this process: rank {r} has already joined");
            let _ = send_answer(&stream, &Answer::Refused(tell));
            self.away.note("claimed a rank that had already joined");
        } else {
            self.joined[r - 1] = Some(stream);
        }
        Ok(())
    }

    /// Every rank is here and agrees: let them start.
    fn welcome(self) -> Result<Vec<TcpStream>, String> {
        let mut peers = Vec::with_capacity(self.joined.len());
        for (i, s) in self.joined.into_iter().flatten().enumerate() {
            let ready = s
                .set_nonblocking(false)
                .and_then(|()| s.set_nodelay(true))
                .and_then(|()| send_answer(&s, &Answer::Welcome));
            ready.map_err(|e| format!("rank {} left during the join: {e}", i + 1))?;
            peers.push(s);
        }
        Ok(peers)
    }
}

/// Ranks 1..: connect to rank 0 (retrying until the join timeout), say hello, and wait for
/// rank 0 to answer that every rank has joined.
pub(super) fn enter(m: &Membership, terms: &Terms) -> Result<TcpStream, String> {
    let deadline = Instant::now() + m.join_timeout;
    let secs = m.join_timeout.as_secs();
    let s = loop {
        match TcpStream::connect(&m.master) {
            Ok(s) => break s,
            Err(e) => {
                if Instant::now() > deadline {
                    return Err(format!(
                        "rank {} could not reach rank 0 at {} within {secs} s: {e}",
                        m.rank, m.master
                    ));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    let answer_by = Instant::now() + m.join_timeout + ANSWER_GRACE;
    let lost = |e: std::io::Error| {
        format!(
            "rank {}: rank 0 at {} ended the join without an answer ({e}); rank 0's own \
             message says why",
            m.rank, m.master
        )
    };
    // Whoever listens there may not read: the hello must not block past the join either.
    s.set_write_timeout(Some(m.join_timeout + ANSWER_GRACE))
        .and_then(|()| (&s).write_all(&hello_bytes(m.rank, m.world, &m.token, terms)))
        .map_err(lost)?;
    match read_answer(&s, answer_by) {
        Ok(Some(Answer::Welcome)) => {}
        Ok(Some(Answer::Refused(why))) => return Err(why),
        Ok(None) => {
            return Err(format!(
                "rank {}: {} did not answer as rank 0 of an osdp-tui run",
                m.rank, m.master
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
            return Err(format!(
                "rank {}: rank 0 at {} did not start the run within {secs} s of this rank \
                 joining",
                m.rank, m.master
            ))
        }
        Err(e) => return Err(lost(e)),
    }
    s.set_read_timeout(None)
        .and_then(|()| s.set_write_timeout(None))
        .and_then(|()| s.set_nodelay(true))
        .map_err(|e| e.to_string())?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use tch::Tensor;

    use super::*;
    use crate::collective::Collective;
    use crate::tcp::TcpGroup;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap()
    }

    fn member(rank: usize, world: usize, port: u16, token: &str, timeout_s: u64) -> Membership {
        Membership {
            rank,
            world,
            master: format!("127.0.0.1:{port}"),
            join_timeout: Duration::from_secs(timeout_s),
            token: RunToken::new(token),
        }
    }

    fn terms(lr: f64, seed: u64) -> Terms {
        Terms::default()
            .with("model", "0123456789abcdef")
            .with("lr", lr)
            .with("seed", seed)
    }

    /// Rank 0 joining in a thread; returns once it listens.
    fn rank0(m: Membership, t: Terms) -> std::thread::JoinHandle<Result<TcpGroup, String>> {
        let port = m.master.clone();
        let h = std::thread::spawn(move || TcpGroup::join(&m, &t));
        let until = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(&port).is_err() {
            assert!(Instant::now() < until, "rank 0 never listened");
            std::thread::sleep(Duration::from_millis(10));
        }
        h
    }

    fn connect(port: u16) -> TcpStream {
        TcpStream::connect(("127.0.0.1", port)).unwrap()
    }

    /// Whatever rank 0 answers a stranger, or `None` when it hangs up without a word.
    fn answer_to(s: &TcpStream) -> Option<Answer> {
        read_answer(s, Instant::now() + Duration::from_secs(10))
            .ok()
            .flatten()
    }

    #[test]
    fn strangers_on_the_port_do_not_hold_up_or_replace_the_real_ranks() {
        let port = free_port();
        let h0 = rank0(member(0, 2, port, "secret", 20), terms(3e-4, 1));
        let started = Instant::now();
        // One says nothing and stays; one sends an HTTP request; one guesses the token; one
        // announces a hello of 2 GiB; one sends half a header and stops.
        let _silent = connect(port);
        let mut garbage = connect(port);
        garbage
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut guess = connect(port);
        guess
            .write_all(&hello_bytes(1, 2, &RunToken::new("guess"), &terms(3e-4, 1)))
            .unwrap();
        let mut huge = connect(port);
        let mut head = Vec::new();
        for v in [MAGIC, PROTOCOL, 1, 2, 6, 1 << 31] {
            head.extend_from_slice(&v.to_le_bytes());
        }
        head.extend_from_slice(b"secret");
        huge.write_all(&head).unwrap();
        let mut half = connect(port);
        half.write_all(&head[..10]).unwrap();
        // The real rank 1.
        let m1 = member(1, 2, port, "secret", 20);
        let h1 = std::thread::spawn(move || TcpGroup::join(&m1, &terms(3e-4, 1)));
        let (g0, g1) = (h0.join().unwrap(), h1.join().unwrap());
        let (g0, g1) = (g0.unwrap(), g1.unwrap());
        assert!(
            started.elapsed() < HELLO_TIMEOUT,
            "the join waited for a stranger: {:?}",
            started.elapsed()
        );
        let Some(Answer::Refused(why)) = answer_to(&guess) else {
            panic!("the wrong token is answered with a refusal")
        };
        assert!(why.contains("run token"), "{why}");
        assert_eq!(
            answer_to(&huge),
            None,
            "an oversized hello is dropped unread"
        );
        assert_eq!(answer_to(&garbage), None);
        // The group is the two real ranks.
        let h = std::thread::spawn(move || {
            g1.all_reduce(&Tensor::from(2.0f64))
                .unwrap()
                .double_value(&[])
        });
        let sum = g0
            .all_reduce(&Tensor::from(1.0f64))
            .unwrap()
            .double_value(&[]);
        assert_eq!((sum, h.join().unwrap()), (3.0, 3.0));
    }

    #[test]
    fn a_join_among_strangers_ends_at_its_deadline_with_a_message() {
        let port = free_port();
        let h0 = rank0(member(0, 2, port, "secret", 2), terms(3e-4, 1));
        let started = Instant::now();
        // More silent connections than rank 0 keeps, and one that trickles a byte at a time.
        let _silent: Vec<TcpStream> = (0..MAX_PENDING + 10).map(|_| connect(port)).collect();
        let mut trickle = connect(port);
        let bytes = hello_bytes(1, 2, &RunToken::new("secret"), &terms(3e-4, 1));
        for b in &bytes[..20] {
            if trickle.write_all(std::slice::from_ref(b)).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let Err(why) = h0.join().unwrap() else {
            panic!("no rank 1 joined")
        };
        let took = started.elapsed();
        assert!(took < Duration::from_secs(4), "the deadline held: {took:?}");
        assert!(why.contains("rank(s) 1 did not join"), "{why}");
        assert!(why.contains("within 2 s"), "{why}");
        assert!(
            why.contains("turned away") && why.contains("still sending their hello"),
            "{why}"
        );
    }

    #[test]
    fn a_rank_with_another_learning_rate_is_refused_with_the_field_named() {
        let port = free_port();
        let h0 = rank0(member(0, 3, port, "t", 20), terms(3e-4, 1));
        // Rank 1 agrees and waits; rank 2 was started with another learning rate.
        let m1 = member(1, 3, port, "t", 20);
        let h1 = std::thread::spawn(move || TcpGroup::join(&m1, &terms(3e-4, 1)));
        std::thread::sleep(Duration::from_millis(200));
        let m2 = member(2, 3, port, "t", 20);
        let h2 = std::thread::spawn(move || TcpGroup::join(&m2, &terms(1e-3, 1)));
        let err = |h: std::thread::JoinHandle<Result<TcpGroup, String>>| match h.join().unwrap() {
            Ok(_) => panic!("joined a group that disagrees"),
            Err(e) => e,
        };
        let (e0, e1, e2) = (err(h0), err(h1), err(h2));
        let said = "rank 2 has lr 0.001, rank 0 has 0.0003";
        assert_eq!(e0, format!("the ranks disagree: {said}"));
        assert_eq!(e2, format!("rank 0 refused this rank: {said}"));
        assert_eq!(e1, format!("the run cannot start: {said}"));
    }

    #[test]
    fn a_rank_with_another_seed_is_refused_with_the_field_named() {
        let port = free_port();
        let h0 = rank0(member(0, 2, port, "", 20), terms(3e-4, 1));
        let m1 = member(1, 2, port, "", 20);
        let e1 = TcpGroup::join(&m1, &terms(3e-4, 7)).err().unwrap();
        let e0 = h0.join().unwrap().err().unwrap();
        assert!(e1.contains("rank 1 has seed 7, rank 0 has 1"), "{e1}");
        assert!(e0.contains("rank 1 has seed 7, rank 0 has 1"), "{e0}");
    }

    #[test]
    fn terms_name_the_first_field_that_differs_and_print_safely() {
        let ours = terms(3e-4, 1);
        assert_eq!(ours.disagreement(1, &terms(3e-4, 1)), None);
        let theirs = Terms::default()
            .with("model", "\x1b]0;owned\x07")
            .with("lr", 3e-4)
            .with("seed", 1);
        let why = ours.disagreement(4, &theirs).unwrap();
        assert!(why.starts_with("rank 4 has model "), "{why}");
        assert!(
            !why.contains('\x1b'),
            "escape sequences are shown, not sent: {why}"
        );
        let older = Terms::default()
            .with("model", "0123456789abcdef")
            .with("lr", 3e-4);
        let why = ours.disagreement(1, &older).unwrap();
        assert!(why.contains("states no seed"), "{why}");
        let long = terms(3e-4, 1).with(&"x".repeat(10_000), 1);
        assert!(ours.disagreement(1, &long).unwrap().len() < 400);
    }

    #[test]
    fn a_hello_is_checked_part_by_part_as_it_arrives() {
        let token = RunToken::new("secret");
        let hello = hello_bytes(3, 4, &token, &terms(1e-3, 0));
        for cut in 0..hello.len() {
            assert!(
                matches!(examine(&hello[..cut], &token), Examined::Need(n) if n > cut),
                "{cut} bytes are not yet a hello"
            );
        }
        let Examined::Complete(h) = examine(&hello, &token) else {
            panic!("a whole hello")
        };
        assert_eq!((h.rank, h.world, h.terms), (3, 4, terms(1e-3, 0)));
        // A wrong token is refused as soon as the token has arrived, before the terms.
        let wrong = hello_bytes(3, 4, &RunToken::new("secreT"), &terms(1e-3, 0));
        assert!(matches!(
            examine(&wrong[..HELLO_HEAD + 6], &token),
            Examined::Reject(Rejection { tell: Some(_), .. })
        ));
        // Not our magic: refused after four bytes.
        assert!(matches!(examine(b"GET ", &token), Examined::Reject(_)));
        // A token longer than any: refused from the header alone.
        let mut big = hello[..HELLO_HEAD].to_vec();
        big[16..20].copy_from_slice(&(MAX_TOKEN_BYTES as u32 + 1).to_le_bytes());
        assert!(matches!(examine(&big, &token), Examined::Reject(_)));
    }

    #[test]
    fn rank_0_listens_only_where_it_is_told() {
        let port = free_port();
        let h0 = rank0(member(0, 2, port, "", 2), terms(3e-4, 1));
        // Bound to 127.0.0.1: another loopback address of this machine does not reach it.
        assert!(TcpStream::connect(("127.0.0.2", port)).is_err());
        assert!(h0.join().unwrap().is_err());
        let vars = |pairs: &[(&'static str, &'static str)]| {
            let pairs = pairs.to_vec();
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let m = Membership::from_vars(vars(&[("WORLD_SIZE", "2"), ("RANK", "0")]))
            .unwrap()
            .unwrap();
        assert_eq!(
            m.master, "127.0.0.1:29500",
            "loopback unless told otherwise"
        );
        assert!(m.token.is_empty() && m.exposure().is_none());
        let wide = [
            ("WORLD_SIZE", "2"),
            ("RANK", "0"),
            ("MASTER_ADDR", "0.0.0.0"),
        ];
        let m = Membership::from_vars(vars(&wide)).unwrap().unwrap();
        assert!(m.exposure().unwrap().contains("OSDP_RUN_TOKEN is not set"));
        let long: &'static str = Box::leak("x".repeat(MAX_TOKEN_BYTES + 1).into_boxed_str());
        let err = Membership::from_vars(move |k: &str| match k {
            "WORLD_SIZE" => Some("2".into()),
            "RANK" => Some("1".into()),
            "OSDP_RUN_TOKEN" => Some(long.into()),
            _ => None,
        })
        .unwrap_err();
        assert!(err.contains("OSDP_RUN_TOKEN"), "{err}");
    }
}
