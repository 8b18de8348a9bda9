//! A collective backend over TCP for ranks that are separate processes (one per GPU later, or
//! CPU ranks on several machines): rank 0 listens on `MASTER_ADDR:MASTER_PORT`, the others
//! connect ([`join`] checks who they are and that they run the same thing), and every
//! collective goes through rank 0, which reduces in rank order — the same order as the local
//! backend, so a run gives the same bits whichever backend carries it. The same connections are
//! the bootstrap for NCCL: rank 0 can share its unique id over them.

mod join;

use std::io::{Read, Write};
use std::net::TcpStream;

use tch::{Kind, Tensor};

use super::collective::{sum_in_rank_order, Aborted, Collective};
pub use join::{Membership, RunToken, Terms};

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
    /// Join the group under `terms`: rank 0 waits for every other rank, the others connect to
    /// rank 0; either gives up after the join timeout with a message naming who is missing, and
    /// a rank whose terms differ from rank 0's ends the join on every rank.
    pub fn join(m: &Membership, terms: &Terms) -> Result<TcpGroup, String> {
        let peers = if m.rank == 0 {
            join::gather(m, terms)?
        } else {
            vec![join::enter(m, terms)?]
        };
        Ok(TcpGroup {
            rank: m.rank,
            world: m.world,
            peers,
        })
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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use std::net::TcpListener;

    use super::join::{hello_bytes, read_answer, Answer};
    use super::*;

    /// Past the join, a peer that announces a tensor of another size (here 1 TiB) ends the
    /// run with a message instead of an allocation.
    #[test]
    fn a_joined_peer_announcing_a_huge_tensor_ends_the_run_with_a_message() {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let m = Membership {
            rank: 0,
            world: 2,
            master: format!("127.0.0.1:{port}"),
            join_timeout: Duration::from_secs(20),
            token: RunToken::default(),
        };
        let terms = Terms::default().with("lr", 3e-4);
        let t = terms.clone();
        let h0 = std::thread::spawn(move || TcpGroup::join(&m, &t));
        let until = Instant::now() + Duration::from_secs(10);
        let mut peer = loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(Instant::now() < until, "rank 0 never listened: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        };
        peer.write_all(&hello_bytes(1, 2, &RunToken::default(), &terms))
            .unwrap();
        let answer = read_answer(&peer, Instant::now() + Duration::from_secs(10));
        assert_eq!(answer.ok().flatten(), Some(Answer::Welcome));
        let g0 = h0.join().unwrap().unwrap();
        let mut head = vec![0u8];
        head.extend_from_slice(&(1u64 << 40).to_le_bytes());
        peer.write_all(&head).unwrap();
        let Err(Aborted(why)) = g0.all_reduce(&Tensor::from(1.0f32)) else {
            panic!("a huge tensor is refused")
        };
        assert!(
            why.contains("1099511627776 bytes") && why.contains("not part of this run"),
            "{why}"
        );
    }
}
