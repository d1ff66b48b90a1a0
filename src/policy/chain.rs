//! Several policies' stream engines as one: each event goes through them in load
//! order, each seeing what the previous one released.

use bytes::Bytes;
use tokio::time::Instant;

use super::{Block, EventPolicy};

/// Stream engines in load order, run as one [`EventPolicy`].
pub(crate) struct EventChain {
    engines: Vec<Box<dyn EventPolicy>>,
}

impl EventChain {
    pub(crate) fn new(engines: Vec<Box<dyn EventPolicy>>) -> EventChain {
        EventChain { engines }
    }

    /// Passes what engine `from - 1` released through the engines from `from` on.
    fn pass(
        &mut self,
        from: usize,
        mut events: Vec<Bytes>,
        now: Instant,
        out: &mut Vec<Bytes>,
    ) -> Option<Block> {
        for engine in self.engines.iter_mut().skip(from) {
            let mut next = Vec::with_capacity(events.len());
            for event in events {
                if let Some(block) = engine.push(event, now, &mut next) {
                    out.extend(next);
                    return Some(block);
                }
            }
            events = next;
        }
        out.extend(events);
        None
    }
}

impl EventPolicy for EventChain {
    fn may_change(&self) -> bool {
        self.engines.iter().any(|e| e.may_change())
    }

    fn push(&mut self, raw: Bytes, now: Instant, out: &mut Vec<Bytes>) -> Option<Block> {
        self.pass(0, vec![raw], now, out)
    }

    fn release_due(&mut self, now: Instant, out: &mut Vec<Bytes>) {
        for i in 0..self.engines.len() {
            let mut released = Vec::new();
            self.engines[i].release_due(now, &mut released);
            if !released.is_empty() {
                // A block past a release is reported by the engine's own report.
                let _ = self.pass(i + 1, released, now, out);
            }
        }
    }

    fn next_release(&self) -> Option<Instant> {
        self.engines.iter().filter_map(|e| e.next_release()).min()
    }

    fn finish(&mut self, out: &mut Vec<Bytes>) {
        let now = Instant::now();
        for i in 0..self.engines.len() {
            let mut released = Vec::new();
            self.engines[i].finish(&mut released);
            let _ = self.pass(i + 1, released, now, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Upper-cases every event and holds nothing; blocks on `stop`.
    struct Upper;
    impl EventPolicy for Upper {
        fn may_change(&self) -> bool {
            true
        }
        fn push(&mut self, raw: Bytes, _: Instant, out: &mut Vec<Bytes>) -> Option<Block> {
            if raw.as_ref() == b"stop" {
                return Some(Block {
                    status: http::StatusCode::FORBIDDEN,
                    error_type: None,
                    message: "stopped".into(),
                    rule: "upper".into(),
                    retry_after: None,
                });
            }
            out.push(Bytes::from(raw.to_ascii_uppercase()));
            None
        }
        fn release_due(&mut self, _: Instant, _: &mut Vec<Bytes>) {}
        fn next_release(&self) -> Option<Instant> {
            None
        }
        fn finish(&mut self, _: &mut Vec<Bytes>) {}
    }

    /// Holds every event until the stream ends, then doubles it.
    #[derive(Default)]
    struct HoldAll(Vec<Bytes>);
    impl EventPolicy for HoldAll {
        fn may_change(&self) -> bool {
            true
        }
        fn push(&mut self, raw: Bytes, _: Instant, _: &mut Vec<Bytes>) -> Option<Block> {
            self.0.push(raw);
            None
        }
        fn release_due(&mut self, _: Instant, _: &mut Vec<Bytes>) {}
        fn next_release(&self) -> Option<Instant> {
            None
        }
        fn finish(&mut self, out: &mut Vec<Bytes>) {
            for e in self.0.drain(..) {
                out.push(Bytes::from([e.as_ref(), e.as_ref()].concat()));
            }
        }
    }

    #[test]
    fn each_engine_sees_what_the_previous_released_in_load_order() {
        let mut chain = EventChain::new(vec![Box::new(HoldAll::default()), Box::new(Upper)]);
        let mut out = Vec::new();
        assert!(
            chain
                .push(Bytes::from_static(b"ab"), Instant::now(), &mut out)
                .is_none()
        );
        assert!(out.is_empty(), "the first engine holds");
        chain.finish(&mut out);
        assert_eq!(out, vec![Bytes::from_static(b"ABAB")]);

        let mut chain = EventChain::new(vec![Box::new(Upper), Box::new(HoldAll::default())]);
        let mut out = Vec::new();
        chain.push(Bytes::from_static(b"ab"), Instant::now(), &mut out);
        chain.finish(&mut out);
        assert_eq!(out, vec![Bytes::from_static(b"ABAB")]);
    }

    #[test]
    fn a_block_stops_the_chain_at_the_engine_that_blocked() {
        let mut chain = EventChain::new(vec![Box::new(Upper), Box::new(Upper)]);
        let mut out = Vec::new();
        let block = chain.push(Bytes::from_static(b"stop"), Instant::now(), &mut out);
        assert_eq!(block.map(|b| b.message), Some("stopped".to_owned()));
        assert!(out.is_empty());
    }
}
