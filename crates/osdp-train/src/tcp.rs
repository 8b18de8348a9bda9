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

use std::sync::Arc;

use super::collective::{check_node_size, sum_in_rank_order, Aborted, Collective, NodeGroups};
pub use join::{Membership, RunToken, Terms};

/// One process's handle on the group.
pub struct TcpGroup {
    links: Links,
    /// The node groups, when [`TcpGroup::with_nodes`] arranged the ranks in several nodes.
    nodes: Option<NodeGroups>,
}

/// The connections of one process, shared by its group and its node groups (every collective
/// of any of them goes through rank 0, one at a time).
#[derive(Clone)]
struct Links {
    rank: usize,
    world: usize,
    /// Rank 0: streams to ranks 1.. in order. Others: one stream to rank 0.
    peers: Arc<Vec<TcpStream>>,
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
            links: Links {
                rank: m.rank,
                world: m.world,
                peers: Arc::new(peers),
            },
            nodes: None,
        })
    }

    /// The group with its ranks arranged as nodes of `ranks_per_node` consecutive ranks (see
    /// [`NodeGroups`]); unchanged when that is one node. Every process must arrange the same.
    pub fn with_nodes(self, ranks_per_node: usize) -> Result<TcpGroup, String> {
        let world = self.links.world;
        check_node_size(world, ranks_per_node)?;
        if ranks_per_node >= world {
            return Ok(self);
        }
        let part = |across| {
            Box::new(TcpPart {
                links: self.links.clone(),
                ranks_per_node,
                across,
            }) as Box<dyn Collective>
        };
        let nodes = NodeGroups {
            shard: part(false),
            replica: part(true),
        };
        Ok(TcpGroup {
            nodes: Some(nodes),
            ..self
        })
    }

    /// The connections to the other processes (rank 0: one per other rank; the others: one
    /// to rank 0), for a backend that bootstraps over this group and then watches them.
    pub fn into_streams(self) -> Vec<TcpStream> {
        drop(self.nodes);
        Arc::try_unwrap(self.links.peers)
            .unwrap_or_else(|shared| shared.iter().filter_map(|s| s.try_clone().ok()).collect())
    }
}

impl Links {
    /// Rank 0: every rank's tensor, in rank order (its own first). Others: send theirs.
    fn gather_to_root(&self, t: &Tensor) -> Result<Option<Vec<Tensor>>, Aborted> {
        if self.rank == 0 {
            // Every rank sends a tensor of the same size as ours: anything else is refused
            // before a byte of it is allocated.
            let expected = Wire::of(t.kind(), t.numel());
            let mut all = vec![t.reshape([-1])];
            for s in self.peers.iter() {
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
        self.links.rank
    }
    fn world(&self) -> usize {
        self.links.world
    }
    fn all_gather(&self, shard: &Tensor) -> Result<Tensor, Aborted> {
        let kind = shard.kind();
        let full = self
            .links
            .gather_to_root(shard)?
            .map(|a| Tensor::cat(&a, 0));
        let same = full.as_ref().map(|f| move |_: usize| f.shallow_clone());
        let out = self.links.scatter_from_root(
            same.as_ref().map(|c| c as &dyn Fn(usize) -> Tensor),
            Wire::of(kind, shard.numel() * self.links.world),
        )?;
        Ok(out.to_kind(kind))
    }
    fn reduce_scatter(&self, full: &Tensor) -> Result<Tensor, Aborted> {
        let kind = full.kind();
        let chunk = full.size()[0] / self.links.world as i64;
        let sum = self
            .links
            .gather_to_root(full)?
            .map(|a| sum_in_rank_order(&a));
        let part = sum
            .as_ref()
            .map(|s| move |r: usize| s.narrow(0, r as i64 * chunk, chunk));
        let out = self.links.scatter_from_root(
            part.as_ref().map(|c| c as &dyn Fn(usize) -> Tensor),
            Wire::of(kind, chunk as usize),
        )?;
        Ok(out.to_kind(kind))
    }
    fn all_reduce(&self, t: &Tensor) -> Result<Tensor, Aborted> {
        let (kind, shape) = (t.kind(), t.size());
        let sum = self.links.gather_to_root(t)?.map(|a| sum_in_rank_order(&a));
        let same = sum.as_ref().map(|f| move |_: usize| f.shallow_clone());
        let out = self.links.scatter_from_root(
            same.as_ref().map(|c| c as &dyn Fn(usize) -> Tensor),
            Wire::of(kind, t.numel()),
        )?;
        Ok(out.to_kind(kind).reshape(shape.as_slice()))
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor, Aborted> {
        let (kind, shape) = (t.kind(), t.size());
        let chosen = self
            .links
            .gather_to_root(t)?
            .map(|a| a[root].shallow_clone());
        let same = chosen.as_ref().map(|f| move |_: usize| f.shallow_clone());
        let out = self.links.scatter_from_root(
            same.as_ref().map(|c| c as &dyn Fn(usize) -> Tensor),
            Wire::of(kind, t.numel()),
        )?;
        Ok(out.to_kind(kind).reshape(shape.as_slice()))
    }
    fn barrier(&self) -> Result<(), Aborted> {
        self.all_reduce(&Tensor::from(0.0f64)).map(|_| ())
    }
    fn nodes(&self) -> Option<&NodeGroups> {
        self.nodes.as_ref()
    }
}

/// One of the groups the ranks are partitioned into — every node's ranks, or every local
/// index's ranks across the nodes — over the whole group's connections. Every rank runs the
/// same collective on its own group at the same time (the executor's ranks run in step), so
/// rank 0 receives every rank's tensor, reduces each group in its rank order and sends each
/// rank its group's result: the local backend's bits.
struct TcpPart {
    links: Links,
    ranks_per_node: usize,
    /// The replica groups (one rank per node) rather than the nodes.
    across: bool,
}

impl TcpPart {
    /// Which group rank `r` is in, and its rank there.
    fn place(&self, r: usize) -> (usize, usize) {
        let (node, local) = (r / self.ranks_per_node, r % self.ranks_per_node);
        if self.across {
            (local, node)
        } else {
            (node, local)
        }
    }

    fn size(&self) -> usize {
        if self.across {
            self.links.world / self.ranks_per_node
        } else {
            self.ranks_per_node
        }
    }

    /// The world ranks of group `g`, in group rank order.
    fn members(&self, g: usize) -> Vec<usize> {
        let rpn = self.ranks_per_node;
        (0..self.size())
            .map(|k| {
                if self.across {
                    k * rpn + g
                } else {
                    g * rpn + k
                }
            })
            .collect()
    }

    /// Rank 0: every group's tensors in group rank order, by group. Others: send theirs.
    fn by_group(&self, t: &Tensor) -> Result<Option<Vec<Vec<Tensor>>>, Aborted> {
        let groups = self.links.world / self.size();
        Ok(self.links.gather_to_root(t)?.map(|all| {
            (0..groups)
                .map(|g| {
                    self.members(g)
                        .into_iter()
                        .map(|r| all[r].shallow_clone())
                        .collect()
                })
                .collect()
        }))
    }

    /// Rank 0 sends each rank `out(group, group rank)`; the others receive theirs.
    fn reply(
        &self,
        out: Option<impl Fn(usize, usize) -> Tensor>,
        expected: Wire,
    ) -> Result<Tensor, Aborted> {
        let to_rank = out.map(|f| {
            move |r: usize| {
                let (g, k) = self.place(r);
                f(g, k)
            }
        });
        self.links.scatter_from_root(
            to_rank.as_ref().map(|c| c as &dyn Fn(usize) -> Tensor),
            expected,
        )
    }
}

impl Collective for TcpPart {
    fn rank(&self) -> usize {
        self.place(self.links.rank).1
    }
    fn world(&self) -> usize {
        self.size()
    }
    fn all_gather(&self, shard: &Tensor) -> Result<Tensor, Aborted> {
        let kind = shard.kind();
        let full: Option<Vec<Tensor>> = self
            .by_group(shard)?
            .map(|groups| groups.iter().map(|g| Tensor::cat(g, 0)).collect());
        let out = self.reply(
            full.as_ref()
                .map(|f| move |g: usize, _| f[g].shallow_clone()),
            Wire::of(kind, shard.numel() * self.size()),
        )?;
        Ok(out.to_kind(kind))
    }
    fn reduce_scatter(&self, full: &Tensor) -> Result<Tensor, Aborted> {
        let kind = full.kind();
        let chunk = full.size()[0] / self.size() as i64;
        let sums: Option<Vec<Tensor>> = self
            .by_group(full)?
            .map(|groups| groups.iter().map(|g| sum_in_rank_order(g)).collect());
        let out = self.reply(
            sums.as_ref()
                .map(|s| move |g: usize, k: usize| s[g].narrow(0, k as i64 * chunk, chunk)),
            Wire::of(kind, chunk as usize),
        )?;
        Ok(out.to_kind(kind))
    }
    fn all_reduce(&self, t: &Tensor) -> Result<Tensor, Aborted> {
        let (kind, shape) = (t.kind(), t.size());
        let sums: Option<Vec<Tensor>> = self
            .by_group(t)?
            .map(|groups| groups.iter().map(|g| sum_in_rank_order(g)).collect());
        let out = self.reply(
            sums.as_ref()
                .map(|s| move |g: usize, _| s[g].shallow_clone()),
            Wire::of(kind, t.numel()),
        )?;
        Ok(out.to_kind(kind).reshape(shape.as_slice()))
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor, Aborted> {
        let (kind, shape) = (t.kind(), t.size());
        let chosen: Option<Vec<Tensor>> = self
            .by_group(t)?
            .map(|groups| groups.iter().map(|g| g[root].shallow_clone()).collect());
        let out = self.reply(
            chosen
                .as_ref()
                .map(|c| move |g: usize, _| c[g].shallow_clone()),
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

    /// Four processes (threads here) as two nodes of two: each node's ranks and each local
    /// index's ranks exchange as their own groups, with the local backend's results.
    #[test]
    fn node_groups_over_tcp_give_the_local_backends_results() {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let run = |rank: usize, g: &dyn Collective| -> Vec<Vec<f32>> {
            let n = g.nodes().expect("two nodes");
            let r = rank as f32;
            let full = Tensor::from_slice(&[r, 1.0, 2.0 * r, 3.0]);
            let out = [
                n.shard.all_gather(&Tensor::from_slice(&[r, r + 10.0])),
                n.shard.reduce_scatter(&full),
                n.replica.all_reduce(&Tensor::from_slice(&[r])),
                n.replica.reduce_scatter(&full),
                n.shard.broadcast(&Tensor::from_slice(&[r]), 1),
                g.all_reduce(&Tensor::from_slice(&[r])),
            ];
            out.into_iter()
                .map(|t| Vec::<f32>::try_from(t.unwrap().reshape([-1])).unwrap())
                .collect()
        };
        let handles: Vec<_> = (0..4)
            .map(|rank| {
                std::thread::spawn(move || {
                    let m = Membership {
                        rank,
                        world: 4,
                        master: format!("127.0.0.1:{port}"),
                        join_timeout: Duration::from_secs(20),
                        token: RunToken::default(),
                    };
                    let g = TcpGroup::join(&m, &Terms::default())
                        .and_then(|g| g.with_nodes(2))
                        .unwrap();
                    run(rank, &g)
                })
            })
            .collect();
        let tcp: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let local: Vec<_> = crate::collective::LocalGroup::with_nodes(4, 2)
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(rank, g)| std::thread::spawn(move || run(rank, &g)))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        assert_eq!(tcp, local);
        // Rank 3 is local rank 1 of node 1: its node is ranks 2 and 3, its replicas 1 and 3.
        assert_eq!(tcp[3][0], vec![2.0, 12.0, 3.0, 13.0]);
        assert_eq!(tcp[3][2], vec![4.0]);
        assert_eq!(tcp[3][4], vec![3.0]);
    }

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
