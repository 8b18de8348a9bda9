//! Training data: token windows drawn from a corpus, or random tokens for speed runs.
//!
//! Sample `i` of step `t` depends only on `(seed, t, i)`, never on the world size: rank `r` of
//! `N` takes global samples `r·B/N .. (r+1)·B/N`, so any world size sees the same global batch
//! and a resumed run continues exactly where the checkpoint's step left off.

/// The built-in corpus (public domain; see `data/README.md`).
pub const SHAKESPEARE: &[u8] = include_bytes!("../../../data/shakespeare.txt");

/// Where tokens come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// Byte-level tokens of a text, with the name `--data` gave it (`shakespeare` or a path).
    Text {
        name: String,
        bytes: std::sync::Arc<Vec<u8>>,
    },
    /// Tokens read by [`load::open`]: pre-tokenized, or text through a tokenizer.
    Tokens {
        name: String,
        tokens: std::sync::Arc<Vec<u32>>,
    },
    /// Uniform random tokens below the vocabulary size.
    Random,
}

pub mod load;

impl Source {
    /// Every token in order (byte-level text as bytes); `None` for random tokens.
    pub fn tokens(&self) -> Option<Vec<i64>> {
        match self {
            Source::Text { bytes, .. } => Some(bytes.iter().map(|&b| i64::from(b)).collect()),
            Source::Tokens { tokens, .. } => Some(tokens.iter().map(|&t| i64::from(t)).collect()),
            Source::Random => None,
        }
    }

    pub fn shakespeare() -> Source {
        Source::Text {
            name: "shakespeare".into(),
            bytes: std::sync::Arc::new(SHAKESPEARE.to_vec()),
        }
    }

    /// What `--data` names it: `shakespeare`, `random` or the file's path. Checkpoints record
    /// it, so a resumed run reads the same data.
    pub fn label(&self) -> &str {
        match self {
            Source::Text { name, .. } | Source::Tokens { name, .. } => name,
            Source::Random => "random",
        }
    }
}

/// SplitMix64: a tiny, well-mixed generator; enough for sampling offsets and initial weights.
#[derive(Debug, Clone)]
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> SplitMix {
        SplitMix(seed)
    }

    /// A generator for one named stream: the same `(seed, name)` always gives the same values.
    pub fn for_name(seed: u64, name: &str) -> SplitMix {
        let mut h = seed ^ 0x9e37_79b9_7f4a_7c15;
        for b in name.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        SplitMix(h)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(self.0)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        unit(self.next_u64())
    }

    /// Standard normal (Box–Muller), from the next two draws.
    pub fn next_normal(&mut self) -> f64 {
        let z = self.normal_at(0);
        self.0 = self.0.wrapping_add(GOLDEN.wrapping_mul(2));
        z
    }

    /// The normal the `k`-th call of [`SplitMix::next_normal`] from this state would give,
    /// without stepping: the state is a counter, so any stretch of the stream can be computed
    /// on its own (and in parallel, as the trainer's initialisation does).
    pub fn normal_at(&self, k: u64) -> f64 {
        let draw = |i: u64| unit(mix(self.0.wrapping_add(GOLDEN.wrapping_mul(i))));
        box_muller(draw(2 * k + 1), draw(2 * k + 2))
    }
}

/// SplitMix64's increment.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// A standard normal from two uniforms in `[0, 1)` (the first kept off 0).
fn box_muller(u1: f64, u2: f64) -> f64 {
    (-2.0 * u1.max(f64::MIN_POSITIVE).ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// One rank's share of a step: inputs and next-token labels, row-major `[rows, seq]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub rows: usize,
    pub seq: usize,
    pub inputs: Vec<i64>,
    pub labels: Vec<i64>,
}

/// Draws the global batch of any step.
#[derive(Debug, Clone)]
pub struct Sampler {
    pub source: Source,
    pub seed: u64,
    pub seq: usize,
    pub vocab: u64,
}

impl Sampler {
    /// Global samples `first .. first + rows` of step `step`.
    pub fn batch(&self, step: u64, first: usize, rows: usize) -> Batch {
        let mut inputs = Vec::with_capacity(rows * self.seq);
        let mut labels = Vec::with_capacity(rows * self.seq);
        for i in first..first + rows {
            let mut rng = SplitMix::new(
                self.seed
                    .wrapping_mul(0x2545_f491_4f6c_dd1d)
                    .wrapping_add(step.wrapping_mul(1_000_003))
                    .wrapping_add(i as u64),
            );
            let window: Vec<i64> = match &self.source {
                Source::Text { bytes: text, .. } => {
                    let span = text.len().saturating_sub(self.seq + 1).max(1);
                    let start = (rng.next_u64() % span as u64) as usize;
                    (0..=self.seq)
                        .map(|j| {
                            i64::from(*text.get(start + j).unwrap_or(&b' ')) % self.vocab as i64
                        })
                        .collect()
                }
                Source::Tokens { tokens, .. } => {
                    let span = tokens.len().saturating_sub(self.seq + 1).max(1);
                    let start = (rng.next_u64() % span as u64) as usize;
                    (0..=self.seq)
                        .map(|j| i64::from(*tokens.get(start + j).unwrap_or(&0)))
                        .collect()
                }
                Source::Random => (0..=self.seq)
                    .map(|_| (rng.next_u64() % self.vocab) as i64)
                    .collect(),
            };
            inputs.extend_from_slice(&window[..self.seq]);
            labels.extend_from_slice(&window[1..]);
        }
        Batch {
            rows,
            seq: self.seq,
            inputs,
            labels,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(source: Source) -> Sampler {
        Sampler {
            source,
            seed: 7,
            seq: 16,
            vocab: 256,
        }
    }

    #[test]
    fn ranks_split_the_same_global_batch() {
        let s = sampler(Source::shakespeare());
        let whole = s.batch(3, 0, 4);
        let a = s.batch(3, 0, 2);
        let b = s.batch(3, 2, 2);
        assert_eq!([a.inputs, b.inputs].concat(), whole.inputs);
        assert_ne!(
            s.batch(4, 0, 4).inputs,
            whole.inputs,
            "steps draw new windows"
        );
    }

    #[test]
    fn labels_are_the_next_bytes_of_real_text() {
        let s = sampler(Source::shakespeare());
        let b = s.batch(0, 0, 1);
        assert_eq!(&b.inputs[1..], &b.labels[..15]);
        let text: String = b.inputs.iter().map(|&t| t as u8 as char).collect();
        assert!(text.is_ascii(), "{text:?}");
    }

    #[test]
    fn random_tokens_stay_below_the_vocabulary() {
        let mut s = sampler(Source::Random);
        s.vocab = 10;
        assert!(s
            .batch(1, 0, 3)
            .inputs
            .iter()
            .all(|&t| (0..10).contains(&t)));
    }
}
