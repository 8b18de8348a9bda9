//! The rendezvous of a multi-process run, which trusts no one who reaches the port and tells
//! no one its secret: rank 0 listens only on `MASTER_ADDR` and opens every connection with a
//! fresh challenge; a rank answers with a hello — its rank, a nonce of its own and the run's
//! [`Terms`] — sealed with an HMAC-SHA256 keyed by the run token (`OSDP_RUN_TOKEN`, which every
//! rank must have and which never crosses the wire). Rank 0 drops a connection whose seal is
//! wrong, with no whole hello in time, with garbage or with an oversized hello, and keeps
//! waiting for the real ranks, reading every connection at once; a rank whose terms differ
//! (another model, plan, seed, learning rate…) ends the join on every rank with a message naming
//! the field. Rank 0 answers only when every rank has joined, and seals its answer too, so a
//! process squatting on the port can neither learn the token nor start a rank.

use std::collections::{BTreeMap, VecDeque};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::env::{self, OSDP_RUN_TOKEN};

const MAGIC: u32 = 0x05D9_7C01;
/// Version of the join handshake: a rank of a build that speaks another is refused by name.
const PROTOCOL: u32 = 3;
/// Bytes of a nonce (rank 0's challenge, a rank's own) and of a seal.
const NONCE_BYTES: usize = 32;
const SEAL_BYTES: usize = 32;
/// Rank 0's challenge: magic, protocol, nonce.
const CHALLENGE_BYTES: usize = 8 + NONCE_BYTES;
/// Bytes of a hello before its terms: magic, protocol, rank, world, the terms' length, the
/// rank's nonce and the seal.
const HELLO_HEAD: usize = 20 + NONCE_BYTES + SEAL_BYTES;
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
/// How long every collective waits for a silent peer unless `OSDP_COLLECTIVE_TIMEOUT_S` says.
const COLLECTIVE_TIMEOUT_S: u64 = 300;

/// The secret every rank of a run holds (`OSDP_RUN_TOKEN`): the key of every seal of the join,
/// never sent, never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct RunToken(String);

impl RunToken {
    pub fn new(token: impl Into<String>) -> RunToken {
        RunToken(token.into())
    }

    /// The seal of `parts` under this token for `purpose`: HMAC-SHA256 over the purpose and
    /// each part with its length, so no two different messages share a sealed byte string.
    fn seal(&self, purpose: &[u8], parts: &[&[u8]]) -> [u8; SEAL_BYTES] {
        self.keyed(purpose, parts).finalize().into_bytes().into()
    }

    /// Whether `presented` is the seal of `parts`, compared in constant time.
    fn opens(&self, presented: &[u8], purpose: &[u8], parts: &[&[u8]]) -> bool {
        self.keyed(purpose, parts).verify_slice(presented).is_ok()
    }

    fn keyed(&self, purpose: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
        // HMAC takes a key of any length (a long one is hashed first): this cannot fail.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(self.0.as_bytes())
            .expect("HMAC accepts a key of any length");
        mac.update(purpose);
        for part in parts {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac
    }
}

impl std::fmt::Debug for RunToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RunToken(…)")
    }
}

/// A fresh nonce from the kernel's generator.
fn nonce() -> Result<[u8; NONCE_BYTES], String> {
    let mut n = [0u8; NONCE_BYTES];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut n))
        .map_err(|e| format!("cannot read /dev/urandom for the join's nonces: {e}"))?;
    Ok(n)
}

/// This process's rank and how to reach the others, from the torchrun/Slurm environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    pub rank: usize,
    pub world: usize,
    /// `MASTER_ADDR:MASTER_PORT`: where rank 0 listens (and binds: nowhere else).
    pub master: String,
    pub join_timeout: Duration,
    /// How long any collective waits for a peer that sends nothing, not even its heartbeat.
    pub collective_timeout: Duration,
    pub token: RunToken,
}

impl Membership {
    /// `RANK`, `WORLD_SIZE` (or Slurm's `SLURM_PROCID`, `SLURM_NTASKS`), `MASTER_ADDR`
    /// (default 127.0.0.1), `MASTER_PORT` (default 29500), `OSDP_JOIN_TIMEOUT_S` (default
    /// 120), `OSDP_COLLECTIVE_TIMEOUT_S` (default 300) and `OSDP_RUN_TOKEN` (required when
    /// `WORLD_SIZE` is above 1). `None` when `WORLD_SIZE` is not set.
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
        let seconds = |k: &str, default: u64| -> Result<Duration, String> {
            let s = match var(k) {
                Some(v) => num(k, &v)?.clamp(1, 24 * 3600) as u64,
                None => default,
            };
            Ok(Duration::from_secs(s))
        };
        Ok(Some(Membership {
            rank,
            world,
            master: format!("{addr}:{port}"),
            join_timeout: seconds(env::OSDP_JOIN_TIMEOUT_S, 120)?,
            collective_timeout: seconds(env::OSDP_COLLECTIVE_TIMEOUT_S, COLLECTIVE_TIMEOUT_S)?,
            // A group of one meets no one: only a real group needs the secret.
            token: if world > 1 {
                run_token(var(OSDP_RUN_TOKEN))?
            } else {
                RunToken(String::new())
            },
        }))
    }
}

/// The run token from `OSDP_RUN_TOKEN`'s value: required, and of a sane length.
fn run_token(value: Option<String>) -> Result<RunToken, String> {
    let token = value.unwrap_or_default();
    if token.is_empty() {
        return Err(format!(
            "{OSDP_RUN_TOKEN} is not set: every rank of a multi-process run needs the same secret \
             (e.g. `export {OSDP_RUN_TOKEN}=$(openssl rand -hex 16)` where torchrun or srun is \
             started; the dashboard makes one for the ranks it starts)"
        ));
    }
    if token.len() > MAX_TOKEN_BYTES {
        return Err(format!(
            "{OSDP_RUN_TOKEN} is {} bytes long (at most {MAX_TOKEN_BYTES})",
            token.len()
        ));
    }
    Ok(RunToken(token))
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

/// A complete hello: who the process says it is, its nonce and the terms it runs under.
struct Hello {
    rank: usize,
    world: usize,
    nonce: [u8; NONCE_BYTES],
    terms: Terms,
}

/// What a seal is for: the same bytes sealed for one purpose never pass for another.
const SEALS_HELLO: &[u8] = b"osdp-tui join hello";
const SEALS_ANSWER: &[u8] = b"osdp-tui join answer";

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

/// The message a rank of another build gets.
fn other_protocol(ours: u32, theirs: u32) -> String {
    format!(
        "rank 0 speaks join protocol {ours}, this process {theirs}: run the same osdp-tui on \
         every rank"
    )
}

/// Read a hello, answering `challenge`, as far as `buf` goes, checking each part as soon as it
/// has arrived: the magic before anything else, the announced size before reading what it
/// announces, the seal before the terms are read.
fn examine(buf: &[u8], token: &RunToken, challenge: &[u8; NONCE_BYTES]) -> Examined {
    if buf.len() >= 4 && u32_at(buf, 0) != MAGIC {
        return Examined::Reject(Rejection::silent("sent something other than a hello"));
    }
    if buf.len() < 8 {
        return Examined::Need(8);
    }
    let protocol = u32_at(buf, 4);
    if protocol != PROTOCOL {
        return Examined::Reject(Rejection {
            why: "spoke another version of the handshake",
            tell: Some(other_protocol(PROTOCOL, protocol)),
        });
    }
    if buf.len() < HELLO_HEAD {
        return Examined::Need(HELLO_HEAD);
    }
    let terms_len = u32_at(buf, 16) as usize;
    if terms_len > MAX_TERMS_BYTES {
        return Examined::Reject(Rejection::silent("announced an oversized hello"));
    }
    let end = HELLO_HEAD + terms_len;
    if buf.len() < end {
        return Examined::Need(end);
    }
    let (head, rest) = buf.split_at(20);
    let (nonce, rest) = rest.split_at(NONCE_BYTES);
    let (seal, terms) = (&rest[..SEAL_BYTES], &buf[HELLO_HEAD..end]);
    if !token.opens(seal, SEALS_HELLO, &[challenge, head, nonce, terms]) {
        return Examined::Reject(Rejection {
            why: "did not seal their hello with the run token",
            tell: Some(
                "rank 0 refused this process: its hello is not sealed with this run's token \
                 (OSDP_RUN_TOKEN differs)"
                    .into(),
            ),
        });
    }
    match serde_json::from_slice::<Terms>(terms) {
        Ok(terms) => Examined::Complete(Hello {
            rank: u32_at(buf, 8) as usize,
            world: u32_at(buf, 12) as usize,
            nonce: nonce.try_into().unwrap_or([0; NONCE_BYTES]),
            terms,
        }),
        Err(_) => Examined::Reject(Rejection::silent("sent an unreadable hello")),
    }
}

/// Rank 0's challenge: magic, protocol and a fresh nonce the hello must seal.
fn challenge_bytes(challenge: &[u8; NONCE_BYTES]) -> Vec<u8> {
    let mut out = Vec::with_capacity(CHALLENGE_BYTES);
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&PROTOCOL.to_le_bytes());
    out.extend_from_slice(challenge);
    out
}

/// Who sealed a hello or an answer, and for which exchange: the run's token, rank 0's
/// challenge and the rank's nonce.
pub(super) struct Exchange<'a> {
    pub token: &'a RunToken,
    pub challenge: [u8; NONCE_BYTES],
    pub nonce: [u8; NONCE_BYTES],
}

/// The bytes of rank `rank`'s hello in exchange `x`, sealed with its token.
pub(super) fn hello_bytes(rank: usize, world: usize, x: &Exchange, terms: &Terms) -> Vec<u8> {
    let terms = serde_json::to_vec(terms).unwrap_or_default();
    let mut head = Vec::with_capacity(20);
    for v in [
        MAGIC,
        PROTOCOL,
        rank as u32,
        world as u32,
        terms.len() as u32,
    ] {
        head.extend_from_slice(&v.to_le_bytes());
    }
    let seal = x
        .token
        .seal(SEALS_HELLO, &[&x.challenge, &head, &x.nonce, &terms]);
    let mut out = head;
    out.extend_from_slice(&x.nonce);
    out.extend_from_slice(&seal);
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

/// An answer as a rank read it: whether it came sealed with the rank's own token (rank 0 holds
/// it) or not (a squatter on the port, or a rank 0 with another token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Heard {
    pub answer: Answer,
    pub sealed: bool,
}

fn send_answer(mut s: &TcpStream, answer: &Answer, x: &Exchange) -> std::io::Result<()> {
    let (status, message) = match answer {
        Answer::Welcome => (0u32, ""),
        Answer::Refused(m) => (1, m.as_str()),
    };
    let mut message = message.as_bytes();
    message = &message[..message.len().min(MAX_ANSWER_BYTES)];
    let status_bytes = status.to_le_bytes();
    let seal = x.token.seal(
        SEALS_ANSWER,
        &[&x.challenge, &x.nonce, &status_bytes, message],
    );
    let mut out = Vec::with_capacity(12 + SEAL_BYTES + message.len());
    for v in [MAGIC, status, message.len() as u32] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&seal);
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

/// The nonce of rank 0's challenge, read by `deadline`; `Err` with the message when what came
/// is not an osdp-tui challenge of this protocol.
pub(super) fn read_challenge(
    s: &TcpStream,
    deadline: Instant,
) -> std::io::Result<Result<[u8; NONCE_BYTES], String>> {
    let mut buf = [0u8; CHALLENGE_BYTES];
    read_exact_by(s, &mut buf, deadline)?;
    if u32_at(&buf, 0) != MAGIC {
        return Ok(Err("did not answer as rank 0 of an osdp-tui run".into()));
    }
    let protocol = u32_at(&buf, 4);
    if protocol != PROTOCOL {
        return Ok(Err(other_protocol(protocol, PROTOCOL)));
    }
    Ok(Ok(buf[8..].try_into().unwrap_or([0; NONCE_BYTES])))
}

/// Rank 0's answer in exchange `x`, read by `deadline`; `None` when what came is not an answer.
pub(super) fn read_answer(
    s: &TcpStream,
    deadline: Instant,
    x: &Exchange,
) -> std::io::Result<Option<Heard>> {
    let mut head = [0u8; 12 + SEAL_BYTES];
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
    let sealed = x.token.opens(
        &head[12..],
        SEALS_ANSWER,
        &[&x.challenge, &x.nonce, &status.to_le_bytes(), &message],
    );
    let answer = match status {
        0 => Answer::Welcome,
        _ => Answer::Refused(shown(&String::from_utf8_lossy(&message))),
    };
    Ok(Some(Heard { answer, sealed }))
}

/// A connection rank 0 accepted that has not finished its hello.
struct Pending {
    stream: TcpStream,
    challenge: [u8; NONCE_BYTES],
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
            let need = match examine(&self.buf, token, &self.challenge) {
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

    /// The nonce the other end sent, as far as it came (zeros when it sent none): what rank
    /// 0 seals a refusal with.
    fn claimed_nonce(&self) -> [u8; NONCE_BYTES] {
        self.buf
            .get(20..20 + NONCE_BYTES)
            .and_then(|n| n.try_into().ok())
            .unwrap_or([0; NONCE_BYTES])
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

/// A rank that has joined: its connection and the exchange its answer is sealed for.
struct Joined {
    stream: TcpStream,
    challenge: [u8; NONCE_BYTES],
    nonce: [u8; NONCE_BYTES],
}

impl Joined {
    fn answer(&self, answer: &Answer, token: &RunToken) -> std::io::Result<()> {
        let x = Exchange {
            token,
            challenge: self.challenge,
            nonce: self.nonce,
        };
        send_answer(&self.stream, answer, &x)
    }
}

/// Tell every rank that has joined that the run will not start, and why.
fn refuse_all(joined: &[Option<Joined>], why: &str, token: &RunToken) {
    for j in joined.iter().flatten() {
        let _ = j.answer(&Answer::Refused(why.to_string()), token);
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
    joined: Vec<Option<Joined>>,
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
        let told = format!("the run cannot start: {why}");
        refuse_all(&self.joined, &told, &self.m.token);
        why
    }

    /// Accept the connections waiting on `listener` as pending, each sent its challenge;
    /// whether there were any.
    fn accept(&mut self, listener: &TcpListener, now: Instant) -> Result<bool, String> {
        let mut busy = false;
        // At most a pending queue's worth per round: a flood of connections cannot keep
        // rank 0 accepting past its deadline.
        for _ in 0..MAX_PENDING {
            match listener.accept() {
                Ok((stream, _)) => {
                    busy = true;
                    let challenge = nonce()?;
                    // A fresh socket's buffer takes the 40 bytes at once.
                    let opened = stream
                        .set_nonblocking(true)
                        .and_then(|()| (&stream).write_all(&challenge_bytes(&challenge)));
                    if opened.is_err() {
                        continue;
                    }
                    if self.pending.len() >= MAX_PENDING {
                        self.pending.pop_front();
                        self.away.note("were pushed out by newer connections");
                    }
                    self.pending.push_back(Pending {
                        stream,
                        challenge,
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
                        let x = Exchange {
                            token: &self.m.token,
                            challenge: p.challenge,
                            nonce: p.claimed_nonce(),
                        };
                        let _ = send_answer(&p.stream, &Answer::Refused(tell.clone()), &x);
                    }
                    self.away.note(r.why);
                    self.pending.remove(i);
                }
                Progress::Hello(hello) => {
                    let Some(p) = self.pending.remove(i) else {
                        break;
                    };
                    busy = true;
                    let joined = Joined {
                        stream: p.stream,
                        challenge: p.challenge,
                        nonce: hello.nonce,
                    };
                    self.admit(hello, joined)?;
                }
            }
        }
        Ok(busy)
    }

    /// A whole hello sealed with the run's token: the rank joins if its terms agree and it
    /// claims a rank the run has that has not joined; terms that differ end the join on every
    /// rank.
    fn admit(&mut self, hello: Hello, j: Joined) -> Result<(), String> {
        let (m, token) = (self.m, &self.m.token);
        if let Some(why) = self.terms.disagreement(hello.rank, &hello.terms) {
            let _ = j.answer(
                &Answer::Refused(format!("rank 0 refused this rank: {why}")),
                token,
            );
            refuse_all(&self.joined, &format!("the run cannot start: {why}"), token);
            return Err(format!("the ranks disagree: {why}"));
        }
        let (r, w) = (hello.rank, hello.world);
        if w != m.world || !(1..m.world).contains(&r) {
            let tell = format!(
                "rank 0 refused this process: it says it is rank {r} of {w}, \
                 the run has ranks 1 to {} besides rank 0",
                m.world - 1
            );
            let _ = j.answer(&Answer::Refused(tell), token);
            self.away.note("claimed a rank the run does not have");
        } else if self.joined[r - 1].is_some() {
            let tell = format!("rank 0 refused this process: rank {r} has already joined");
            let _ = j.answer(&Answer::Refused(tell), token);
            self.away.note("claimed a rank that had already joined");
        } else {
            self.joined[r - 1] = Some(j);
        }
        Ok(())
    }

    /// Every rank is here and agrees: let them start.
    fn welcome(self) -> Result<Vec<TcpStream>, String> {
        let mut peers = Vec::with_capacity(self.joined.len());
        for (i, j) in self.joined.into_iter().flatten().enumerate() {
            let ready = j
                .stream
                .set_nonblocking(false)
                .and_then(|()| j.stream.set_nodelay(true))
                .and_then(|()| j.answer(&Answer::Welcome, &self.m.token));
            ready.map_err(|e| format!("rank {} left during the join: {e}", i + 1))?;
            peers.push(j.stream);
        }
        Ok(peers)
    }
}

/// Ranks 1..: connect to rank 0 (retrying until the join timeout), answer its challenge with a
/// sealed hello, and wait for rank 0's sealed answer that every rank has joined.
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
        if e.kind() == std::io::ErrorKind::TimedOut {
            return format!(
                "rank {}: rank 0 at {} did not start the run within {secs} s of this rank \
                 joining",
                m.rank, m.master
            );
        }
        format!(
            "rank {}: rank 0 at {} ended the join without an answer ({e}); rank 0's own \
             message says why",
            m.rank, m.master
        )
    };
    let not_rank_0 = |why: &str| format!("rank {}: {} {why}", m.rank, m.master);
    let challenge = read_challenge(&s, answer_by)
        .map_err(lost)?
        .map_err(|why| not_rank_0(&why))?;
    let x = Exchange {
        token: &m.token,
        challenge,
        nonce: nonce()?,
    };
    // Whoever listens there may not read: the hello must not block past the join either.
    s.set_write_timeout(Some(m.join_timeout + ANSWER_GRACE))
        .and_then(|()| (&s).write_all(&hello_bytes(m.rank, m.world, &x, terms)))
        .map_err(lost)?;
    let heard = read_answer(&s, answer_by, &x)
        .map_err(lost)?
        .ok_or_else(|| not_rank_0("did not answer as rank 0 of an osdp-tui run"))?;
    match heard {
        Heard {
            answer: Answer::Welcome,
            sealed: true,
        } => {}
        Heard {
            answer: Answer::Refused(why),
            sealed: true,
        } => return Err(why),
        Heard { answer, .. } => {
            let said = match answer {
                Answer::Welcome => "let this rank in".to_string(),
                Answer::Refused(why) => format!("refused this rank ({why})"),
            };
            return Err(not_rank_0(&format!(
                "{said} without proving it holds the run token: OSDP_RUN_TOKEN differs between \
                 the ranks, or another process holds the port"
            )));
        }
    }
    s.set_read_timeout(None)
        .and_then(|()| s.set_write_timeout(None))
        .and_then(|()| s.set_nodelay(true))
        .map_err(|e| e.to_string())?;
    Ok(s)
}

/// Say hello as rank `rank` of `world` with `token` over a connection to rank 0 (or to
/// whatever listens there), as a test's stand-in for a rank or a stranger: what it answered.
#[cfg(test)]
pub(super) fn say_hello(
    s: &TcpStream,
    (rank, world): (usize, usize),
    token: &RunToken,
    terms: &Terms,
) -> Option<Heard> {
    let by = Instant::now() + Duration::from_secs(10);
    let challenge = read_challenge(s, by).ok()?.ok()?;
    let x = Exchange {
        token,
        challenge,
        nonce: nonce().ok()?,
    };
    (&*s).write_all(&hello_bytes(rank, world, &x, terms)).ok()?;
    read_answer(s, by, &x).ok().flatten()
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
            collective_timeout: Duration::from_secs(60),
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

    /// Everything rank 0 sends a stranger until it hangs up (or 10 s pass).
    fn all_it_says(mut s: &TcpStream) -> Vec<u8> {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        out
    }

    /// The head of a hello as a stranger may send it: magic, protocol, rank 1 of 2, a terms
    /// length, then a nonce and a seal of zeros.
    fn forged_head(terms_len: u32) -> Vec<u8> {
        let mut head: Vec<u8> = [MAGIC, PROTOCOL, 1, 2, terms_len]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        head.resize(HELLO_HEAD, 0);
        head
    }

    #[test]
    fn strangers_on_the_port_do_not_hold_up_or_replace_the_real_ranks() {
        let port = free_port();
        let h0 = rank0(member(0, 2, port, "secret", 20), terms(3e-4, 1));
        let started = Instant::now();
        // One says nothing and stays; one sends an HTTP request; one claims rank 1 with a
        // guessed token; one announces a hello of 2 GiB; one sends half a header and stops.
        let _silent = connect(port);
        let mut garbage = connect(port);
        garbage
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let guess = connect(port);
        let heard = say_hello(&guess, (1, 2), &RunToken::new("guess"), &terms(3e-4, 1));
        let mut huge = connect(port);
        huge.write_all(&forged_head(1 << 31)).unwrap();
        let mut half = connect(port);
        half.write_all(&forged_head(10)[..10]).unwrap();
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
        let Some(Heard {
            answer: Answer::Refused(why),
            sealed: false,
        }) = heard
        else {
            panic!("a hello sealed with another token is refused: {heard:?}")
        };
        assert!(why.contains("not sealed with this run's token"), "{why}");
        for stranger in [&huge, &garbage] {
            assert_eq!(
                all_it_says(stranger).len(),
                CHALLENGE_BYTES,
                "a stranger gets its challenge and nothing more"
            );
        }
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

    /// A process squatting on the port before rank 0 learns nothing of the token from a real
    /// rank's hello, and cannot start it: its welcome carries no seal of the run's token.
    #[test]
    fn a_squatter_on_the_port_learns_nothing_and_starts_no_one() {
        let port = free_port();
        let squatter = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let token = "a-long-secret-token-0123456789";
        let m1 = member(1, 2, port, token, 5);
        let h1 = std::thread::spawn(move || TcpGroup::join(&m1, &terms(3e-4, 1)));
        let (s, _) = squatter.accept().unwrap();
        let forged = [7u8; NONCE_BYTES];
        (&s).write_all(&challenge_bytes(&forged)).unwrap();
        let mut hello = vec![0u8; HELLO_HEAD];
        (&s).read_exact(&mut hello).unwrap();
        let terms_len = u32_at(&hello, 16) as usize;
        let mut rest = vec![0u8; terms_len];
        (&s).read_exact(&mut rest).unwrap();
        hello.extend_from_slice(&rest);
        assert!(
            !hello.windows(token.len()).any(|w| w == token.as_bytes()),
            "the token never crosses the wire"
        );
        // It welcomes the rank, sealing with a guess.
        let x = Exchange {
            token: &RunToken::new("guess"),
            challenge: forged,
            nonce: hello[20..20 + NONCE_BYTES].try_into().unwrap(),
        };
        send_answer(&s, &Answer::Welcome, &x).unwrap();
        let Err(why) = h1.join().unwrap() else {
            panic!("a rank started on a squatter's word")
        };
        assert!(
            why.contains("let this rank in without proving it holds the run token"),
            "{why}"
        );
    }

    #[test]
    fn a_join_among_strangers_ends_at_its_deadline_with_a_message() {
        let port = free_port();
        let h0 = rank0(member(0, 2, port, "secret", 2), terms(3e-4, 1));
        let started = Instant::now();
        // More silent connections than rank 0 keeps, and one that trickles a byte at a time.
        let _silent: Vec<TcpStream> = (0..MAX_PENDING + 10).map(|_| connect(port)).collect();
        let mut trickle = connect(port);
        for b in &forged_head(10)[..20] {
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
        let h0 = rank0(member(0, 2, port, "t", 20), terms(3e-4, 1));
        let m1 = member(1, 2, port, "t", 20);
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
        let x = Exchange {
            token: &token,
            challenge: [1; NONCE_BYTES],
            nonce: [2; NONCE_BYTES],
        };
        let hello = hello_bytes(3, 4, &x, &terms(1e-3, 0));
        for cut in 0..hello.len() {
            assert!(
                matches!(examine(&hello[..cut], &token, &x.challenge), Examined::Need(n) if n > cut),
                "{cut} bytes are not yet a hello"
            );
        }
        let Examined::Complete(h) = examine(&hello, &token, &x.challenge) else {
            panic!("a whole hello")
        };
        assert_eq!((h.rank, h.world, h.terms), (3, 4, terms(1e-3, 0)));
        // Sealed with another token, or for another challenge (a replay): refused, with a word.
        let other = RunToken::new("secreT");
        let wrong = hello_bytes(3, 4, &Exchange { token: &other, ..x }, &terms(1e-3, 0));
        assert!(matches!(
            examine(&wrong, &token, &x.challenge),
            Examined::Reject(Rejection { tell: Some(_), .. })
        ));
        assert!(matches!(
            examine(&hello, &token, &[9; NONCE_BYTES]),
            Examined::Reject(_)
        ));
        // A rank that says it is another rank than it sealed: the seal covers the head.
        let mut lied = hello.clone();
        lied[8] = 2;
        assert!(matches!(
            examine(&lied, &token, &x.challenge),
            Examined::Reject(_)
        ));
        // Not our magic: refused after four bytes.
        assert!(matches!(
            examine(b"GET ", &token, &x.challenge),
            Examined::Reject(_)
        ));
        // Terms longer than any: refused from the head alone.
        assert!(matches!(
            examine(
                &forged_head(MAX_TERMS_BYTES as u32 + 1),
                &token,
                &x.challenge
            ),
            Examined::Reject(_)
        ));
    }

    fn vars(pairs: &[(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        let pairs = pairs.to_vec();
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn rank_0_listens_only_where_it_is_told() {
        let port = free_port();
        let h0 = rank0(member(0, 2, port, "t", 2), terms(3e-4, 1));
        // Bound to 127.0.0.1: another loopback address of this machine does not reach it.
        assert!(TcpStream::connect(("127.0.0.2", port)).is_err());
        assert!(h0.join().unwrap().is_err());
        let m = Membership::from_vars(vars(&[
            ("WORLD_SIZE", "2"),
            ("RANK", "0"),
            ("OSDP_RUN_TOKEN", "t"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            m.master, "127.0.0.1:29500",
            "loopback unless told otherwise"
        );
        assert_eq!(m.collective_timeout, Duration::from_secs(300));
    }

    #[test]
    fn every_rank_needs_the_run_token_and_may_set_its_deadline() {
        let without = Membership::from_vars(vars(&[("WORLD_SIZE", "2"), ("RANK", "1")]));
        let err = without.unwrap_err();
        assert!(err.starts_with("OSDP_RUN_TOKEN is not set"), "{err}");
        let empty = [("WORLD_SIZE", "2"), ("RANK", "1"), ("OSDP_RUN_TOKEN", "")];
        assert!(Membership::from_vars(vars(&empty)).is_err());
        let alone = [("WORLD_SIZE", "1"), ("RANK", "0")];
        assert!(
            Membership::from_vars(vars(&alone)).is_ok(),
            "a group of one needs no token"
        );
        let long: &'static str = Box::leak("x".repeat(MAX_TOKEN_BYTES + 1).into_boxed_str());
        let too_long = [("WORLD_SIZE", "2"), ("RANK", "1"), ("OSDP_RUN_TOKEN", long)];
        let err = Membership::from_vars(vars(&too_long)).unwrap_err();
        assert!(err.contains("OSDP_RUN_TOKEN is 1025 bytes"), "{err}");
        let set = [
            ("WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("OSDP_RUN_TOKEN", "t"),
            ("OSDP_COLLECTIVE_TIMEOUT_S", "7"),
        ];
        let m = Membership::from_vars(vars(&set)).unwrap().unwrap();
        assert_eq!(m.collective_timeout, Duration::from_secs(7));
        let bad = [
            ("WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("OSDP_RUN_TOKEN", "t"),
            ("OSDP_COLLECTIVE_TIMEOUT_S", "soon"),
        ];
        let err = Membership::from_vars(vars(&bad)).unwrap_err();
        assert!(err.contains("OSDP_COLLECTIVE_TIMEOUT_S"), "{err}");
    }
}
