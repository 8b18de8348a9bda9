//! Memory truth: the bytes one rank's executor holds, by category, with the peak.

/// What a held tensor is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    /// Parameters held all step: full replicas and ZeRO-3 shards.
    Params,
    /// Gradients held until the optimizer step: full (dp, zero1) or shards (zero2, zero3).
    Grads,
    /// AdamW moments (fp32 on every device).
    Optimizer,
    /// ZeRO-3 weights gathered for one op.
    Gathered,
    /// Full gradients waiting to be reduce-scattered, and the step's temporary shards.
    GradBuffers,
    /// Tensors kept from forward for backward (and recomputation checkpoints).
    Activations,
    /// Forward outputs on their way to their consumers, and gradients flowing backward.
    Working,
}

const CATEGORIES: usize = 7;

/// Bytes by category: the protocol's type, so a worker reports exactly what it counted.
pub use osdp_core::protocol::MemoryBreakdown as Breakdown;

fn from_array(a: &[u64; CATEGORIES], host: u64) -> Breakdown {
    Breakdown {
        host,
        params: a[0],
        grads: a[1],
        optimizer: a[2],
        gathered: a[3],
        grad_buffers: a[4],
        activations: a[5],
        working: a[6],
    }
}

#[derive(Debug, Clone, Default)]
pub struct Ledger {
    now: [u64; CATEGORIES],
    peak_total: u64,
    at_peak: [u64; CATEGORIES],
    /// Host memory (offloaded state), apart from the device's categories and their peak.
    host: u64,
}

impl Ledger {
    pub fn add(&mut self, cat: Category, bytes: u64) {
        self.now[cat as usize] += bytes;
        let total: u64 = self.now.iter().sum();
        if total > self.peak_total {
            self.peak_total = total;
            self.at_peak = self.now;
        }
    }

    pub fn sub(&mut self, cat: Category, bytes: u64) {
        let slot = &mut self.now[cat as usize];
        debug_assert!(*slot >= bytes, "ledger underflow in {cat:?}");
        *slot = slot.saturating_sub(bytes);
    }

    /// Bytes now held in host memory.
    pub fn add_host(&mut self, bytes: u64) {
        self.host += bytes;
    }

    pub fn now(&self) -> Breakdown {
        from_array(&self.now, self.host)
    }

    /// The categories at the moment the total peaked (and the host memory held now: it does
    /// not change within a step).
    pub fn peak(&self) -> Breakdown {
        from_array(&self.at_peak, self.host)
    }

    /// Start a new peak window from what is held now.
    pub fn reset_peak(&mut self) {
        self.peak_total = self.now.iter().sum();
        self.at_peak = self.now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_records_the_categories_at_the_highest_total() {
        let mut l = Ledger::default();
        l.add(Category::Params, 100);
        l.add(Category::Gathered, 50);
        l.sub(Category::Gathered, 50);
        l.add(Category::Activations, 30);
        assert_eq!(l.peak().total(), 150);
        assert_eq!(l.peak().gathered, 50);
        assert_eq!(l.now().total(), 130);
        l.reset_peak();
        assert_eq!(l.peak().total(), 130);
    }
}
