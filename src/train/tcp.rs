//! A collective backend over TCP for ranks that are separate processes (one per GPU later, or
//! CPU ranks on several machines): rank 0 listens on `MASTER_ADDR:MASTER_PORT`, the others
//! connect, and every collective goes through rank 0, which reduces in rank order — the same
//! order as the local backend, so a run gives the same bits whichever backend carries it.
//! The same handshake is the bootstrap for NCCL: rank 0 can share its unique id over it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use super::collective::{sum_in_rank_order, Aborted, Collective};

const MAGIC: u32 = 0x05D9_7C01;

/// This process's rank and how to reach the others, from the torchrun/Slurm environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    pub rank: usize,
    pub world: usize,
    /// `MASTER_ADDR:MASTER_PORT`.
    pub master: String,
    pub join_timeout: Duration,
}

impl Membership {
    /// `RANK`, `WORLD_SIZE` (or Slurm's `SLURM_PROCID`, `SLURM_NTASKS`), `MASTER_ADDR`
    /// (default 127.0.0.1), `MASTER_PORT` (default 29500),
    /// and `OSDP_JOIN_TIMEOUT_S` (default 120). `None` when `WORLD_SIZE` is not set.
    ///
    /// Under torchrun (`TORCHELASTIC_RUN_ID` set) its own store already listens on
    /// `MASTER_PORT`, so the group uses the next port; `OSDP_PORT` overrides either.
    pub fn from_env() -> Result<Option<Membership>, String> {
        let var = |k: &str| std::env::var(k).ok();
        // torchrun's names first, Slurm's as the fallback (`srun osdp-tui train …`).
        let Some(world) = var("WORLD_SIZE").or_else(|| var("SLURM_NTASKS")) else {
            return Ok(None);
        };
        let num = |k: &str, v: &str| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| format!("{k}={v:?} is not a number"))
        };
        let world = num("WORLD_SIZE", &world)?;
        let rank = num(
            "RANK",
            &var("RANK").ok_or("WORLD_SIZE is set but RANK is not")?,
        )?;
        if world == 0 || rank >= world {
            return Err(format!("RANK {rank} is not below WORLD_SIZE {world}"));
        }
        let addr = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let master_port = num(
            "MASTER_PORT",
            &var("MASTER_PORT").unwrap_or_else(|| "29500".into()),
        )?;
        let port = match (var("OSDP_PORT"), var("TORCHELASTIC_RUN_ID")) {
            (Some(p), _) => num("OSDP_PORT", &p)?,
            (None, Some(_)) => master_port + 1,
            (None, None) => master_port,
        };
        let timeout = match var("OSDP_JOIN_TIMEOUT_S") {
            Some(v) => num("OSDP_JOIN_TIMEOUT_S", &v)? as u64,
            None => 120,
        };
        Ok(Some(Membership {
            rank,
            world,
            master: format!("{addr}:{port}"),
            join_timeout: Duration::from_secs(timeout),
        }))
    }
}

/// One process's handle on the group.
pub struct TcpGroup {
    rank: usize,
    world: usize,
    /// Rank 0: streams to ranks 1.. in order. Others: one stream to rank 0.
    peers: Vec<TcpStream>,
}

fn io_abort(e: std::io::Error) -> Aborted {
    Aborted(format!("connection to another rank lost: {e}"))
}

impl TcpGroup {
    /// Join the group: rank 0 waits for every other rank, the others connect to rank 0; either
    /// gives up after the join timeout with a message naming who is missing.
    pub fn join(m: &Membership) -> Result<TcpGroup, String> {
        let deadline = Instant::now() + m.join_timeout;
        let secs = m.join_timeout.as_secs();
        if m.rank == 0 {
            let listener = TcpListener::bind(&m.master)
                .map_err(|e| format!("rank 0 cannot listen on {}: {e}", m.master))?;
            listener.set_nonblocking(true).map_err(|e| e.to_string())?;
            let mut peers: Vec<Option<TcpStream>> = (1..m.world).map(|_| None).collect();
            while peers.iter().any(Option::is_none) {
                match listener.accept() {
                    Ok((mut s, _)) => {
                        s.set_nonblocking(false).map_err(|e| e.to_string())?;
                        s.set_read_timeout(Some(m.join_timeout))
                            .map_err(|e| e.to_string())?;
                        let (magic, rank, world) =
                            (read_u32(&mut s), read_u32(&mut s), read_u32(&mut s));
                        match (magic, rank, world) {
                            (Ok(MAGIC), Ok(r), Ok(w))
                                if w as usize == m.world
                                    && (1..m.world).contains(&(r as usize)) =>
                            {
                                s.set_read_timeout(None).map_err(|e| e.to_string())?;
                                s.set_nodelay(true).map_err(|e| e.to_string())?;
                                peers[r as usize - 1] = Some(s);
                            }
                            _ => continue,
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
                            let missing: Vec<String> = peers
                                .iter()
                                .enumerate()
                                .filter(|(_, p)| p.is_none())
                                .map(|(i, _)| (i + 1).to_string())
                                .collect();
                            return Err(format!(
                                "rank(s) {} did not join {} within {secs} s",
                                missing.join(", "),
                                m.master
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(format!("rank 0 accepting on {}: {e}", m.master)),
                }
            }
            Ok(TcpGroup {
                rank: 0,
                world: m.world,
                peers: peers.into_iter().flatten().collect(),
            })
        } else {
            loop {
                match TcpStream::connect(&m.master) {
                    Ok(mut s) => {
                        s.set_nodelay(true).map_err(|e| e.to_string())?;
                        for v in [MAGIC, m.rank as u32, m.world as u32] {
                            s.write_all(&v.to_le_bytes()).map_err(|e| e.to_string())?;
                        }
                        return Ok(TcpGroup {
                            rank: m.rank,
                            world: m.world,
                            peers: vec![s],
                        });
                    }
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
            }
        }
    }

    /// The connections to the other processes (rank 0: one per other rank; the others: one
    /// to rank 0), for a backend that bootstraps over this group and then watches them.
    pub fn into_streams(self) -> Vec<TcpStream> {
        self.peers
    }

    /// Rank 0: every rank's tensor, in rank order (its own first). Others: send theirs.
    fn gather_to_root(&self, t: &Tensor) -> Result<Option<Vec<Tensor>>, Aborted> {
        if self.rank == 0 {
            // Every rank sends a tensor of the same size as ours: anything else is refused
            // before a byte of it is allocated.
            let expected = Wire::of(t.kind(), t.numel());
            let mut all = vec![t.reshape([-1])];
            for s in &self.peers {
                all.push(recv_tensor(s, expected)?);
            }
            Ok(Some(all))
        } else {
            send_tensor(&self.peers[0], t)?;
            Ok(None)
        }
    }

    /// Rank 0 sends `out(r)` to each rank r and keeps `out(0)`; others receive theirs, of
    /// `expected` kind and elements.
    fn scatter_from_root(
        &self,
        out: Option<&dyn Fn(usize) -> Tensor>,
        expected: Wire,
    ) -> Result<Tensor, Aborted> {
        match (self.rank, out) {
            (0, Some(out)) => {
                for (i, s) in self.peers.iter().enumerate() {
                    send_tensor(s, &out(i + 1))?;
                }
                Ok(out(0))
            }
            _ => recv_tensor(&self.peers[0], expected),
        }
    }
}

fn read_u32(s: &mut TcpStream) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn send_tensor(mut s: &TcpStream, t: &Tensor) -> Result<(), Aborted> {
    let t = t.contiguous().reshape([-1]);
    let (tag, bytes): (u8, Vec<u8>) = match t.kind() {
        Kind::Double => (
            1,
            Vec::<f64>::try_from(&t)
                .unwrap_or_default()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
        Kind::Int64 => (
            2,
            Vec::<i64>::try_from(&t)
                .unwrap_or_default()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
        _ => (
            0,
            Vec::<f32>::try_from(&t.to_kind(Kind::Float))
                .unwrap_or_default()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
    };
    let mut head = vec![tag];
    head.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    s.write_all(&head).map_err(io_abort)?;
    s.write_all(&bytes).map_err(io_abort)
}

/// What a tensor looks like on the wire: its tag (0 fp32, 1 f64, 2 i64) and byte length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Wire {
    tag: u8,
    bytes: u64,
}

impl Wire {
    fn of(kind: Kind, numel: usize) -> Wire {
        let (tag, size) = match kind {
            Kind::Double => (1, 8),
            Kind::Int64 => (2, 8),
            _ => (0, 4),
        };
        Wire {
            tag,
            bytes: numel as u64 * size,
        }
    }
}

/// Receive a tensor that must be `expected`: a header announcing anything else (a stranger on
/// the port, a rank of another model or plan) ends the run with a message instead of an
/// allocation of whatever size it claims.
fn recv_tensor(mut s: &TcpStream, expected: Wire) -> Result<Tensor, Aborted> {
    let mut head = [0u8; 9];
    s.read_exact(&mut head).map_err(io_abort)?;
    let len = u64::from_le_bytes(head[1..9].try_into().unwrap_or([0; 8]));
    if head[0] != expected.tag || len != expected.bytes {
        return Err(Aborted(format!(
            "another rank sent a tensor of {len} bytes (type {}) where {} bytes (type {}) were \
             expected: a process that is not part of this run, or one started with another \
             model or plan",
            head[0], expected.bytes, expected.tag
        )));
    }
    let mut bytes = vec![0u8; len as usize];
    s.read_exact(&mut bytes).map_err(io_abort)?;
    Ok(match head[0] {
        1 => Tensor::from_slice(
            &bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect::<Vec<_>>(),
        ),
        2 => Tensor::from_slice(
            &bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect::<Vec<_>>(),
        ),
        _ => Tensor::from_slice(
            &bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap_or([0; 4])))
                .collect::<Vec<_>>(),
        ),
    })
}

impl Collective for TcpGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_gather(&self, shard: &Tensor) -> Result<Tensor, Aborted> {
        let kind = shard.kind();
        let full = self.gather_to_root(shard)?.map(|a| Tensor::cat(&a, 0));
        let same = full.as_ref().map(|f| move |_: usize| f.shallow_clone());
        let out = self.scatter_from_root(
            same.as_ref().map(|c| c as &dyn Fn(usize) -> Tensor),
            Wire::of(kind, shard.numel() * self.world),
        )?;
        Ok(out.to_kind(kind))
    }
    fn reduce_scatter(&self, full: &Tensor) -> Result<Tensor, Aborted> {
        let kind = full.kind();
        let chunk = full.size()[0] / self.world as i64;
        let sum = self.gather_to_root(full)?.map(|a| sum_in_rank_order(&a));
        let part = sum
            .as_ref()
            .map(|s| move |r: usize| s.narrow(0, r as i64 * chunk, chunk));
        let out = self.scatter_from_root(
            part.as_ref().map(|c| c as &dyn Fn(usize) -> Tensor),
            Wire::of(kind, chunk as usize),
        )?;
        Ok(out.to_kind(kind))
    }
    fn all_reduce(&self, t: &Tensor) -> Result<Tensor, Aborted> {
        let (kind, shape) = (t.kind(), t.size());
        let sum = self.gather_to_root(t)?.map(|a| sum_in_rank_order(&a));
        let same = sum.as_ref().map(|f| move |_: usize| f.shallow_clone());
        let out = self.scatter_from_root(
            same.as_ref().map(|c| c as &dyn Fn(usize) -> Tensor),
            Wire::of(kind, t.numel()),
        )?;
        Ok(out.to_kind(kind).reshape(shape.as_slice()))
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor, Aborted> {
        let (kind, shape) = (t.kind(), t.size());
        let chosen = self.gather_to_root(t)?.map(|a| a[root].shallow_clone());
        let same = chosen.as_ref().map(|f| move |_: usize| f.shallow_clone());
        let out = self.scatter_from_root(
            same.as_ref().map(|c| c as &dyn Fn(usize) -> Tensor),
            Wire::of(kind, t.numel()),
        )?;
        Ok(out.to_kind(kind).reshape(shape.as_slice()))
    }
    fn barrier(&self) -> Result<(), Aborted> {
        self.all_reduce(&Tensor::from(0.0f64)).map(|_| ())
    }
}
