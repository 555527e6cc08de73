//! The revisit workload as token ids: pure, no I/O (the runner supplies the answers a
//! conversation continues with).
//!
//! `conversations` conversations, visited for `rounds` rounds. Round 0 sends every conversation's
//! first turn, a `first_tokens`-long opening of its own, in conversation order. Every later round
//! visits every conversation once, in an order drawn from the seed and the round; the prompt is the
//! conversation's whole history (its earlier prompts and answers) followed by `turn_tokens` new
//! ones. With many conversations the histories together outgrow a worker's KV pool, so what a
//! revisit finds cached is what the pool, or a KV tier behind it, kept since the last visit.
//!
//! Invariants: every piece (opening, new turn, warm-up prompt) and every round's order is a pure
//! function of the seed and the piece's name, so a seed names one workload; ids lie in
//! `1..vocab_limit` (0 is often a special token); a round's order is a permutation of the
//! conversations.

/// The sizes of the workload and where its token ids come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Shape {
    pub conversations: usize,
    /// Rounds; the first sends the openings, each later one revisits every conversation.
    pub rounds: usize,
    /// Tokens of a conversation's opening.
    pub first_tokens: usize,
    /// Tokens a revisit adds after the history.
    pub turn_tokens: usize,
    /// Tokens generated per request; they become part of the history.
    pub answer_tokens: usize,
    /// Token ids are drawn below this.
    pub vocab_limit: u32,
    pub seed: u64,
}

/// Names of the pieces, so each draws its own stream of ids from the seed.
const OPENING: u64 = 1;
const TURN: u64 = 2;
const WARM_UP: u64 = 3;
const ORDER: u64 = 4;
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a bijection that scatters nearby inputs.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// SplitMix64 seeded from the workload's seed and a piece's name and indices.
struct Stream(u64);

impl Stream {
    fn new(seed: u64, piece: u64, a: usize, b: usize) -> Stream {
        Stream(mix(mix(mix(seed ^ piece.wrapping_mul(GAMMA)) ^ a as u64) ^ (b as u64).rotate_left(32)))
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        mix(self.0)
    }
}

impl Shape {
    /// `n` ids below `vocab_limit` (and above 0) for piece `piece`, index `a`, `b`.
    fn ids(&self, piece: u64, a: usize, b: usize, n: usize) -> Vec<u32> {
        let mut s = Stream::new(self.seed, piece, a, b);
        let span = u64::from(self.vocab_limit.max(2)) - 1;
        (0..n).map(|_| 1 + (s.next() % span) as u32).collect()
    }

    /// Conversation `conv`'s first prompt.
    pub fn opening(&self, conv: usize) -> Vec<u32> {
        self.ids(OPENING, conv, 0, self.first_tokens)
    }

    /// The tokens round `round` (≥ 1) adds to conversation `conv`.
    pub fn turn(&self, conv: usize, round: usize) -> Vec<u32> {
        self.ids(TURN, conv, round, self.turn_tokens)
    }

    /// Round `round`'s prompt (`round` ≥ 1) of conversation `conv`: its history (every earlier
    /// prompt and answer, which is the previous prompt and its answer), then the round's tokens.
    pub fn revisit(&self, conv: usize, round: usize, history: &[u32]) -> Vec<u32> {
        let mut p = Vec::with_capacity(history.len() + self.turn_tokens);
        p.extend_from_slice(history);
        p.extend(self.turn(conv, round));
        p
    }

    /// The order in which round `round` visits the conversations: in order for the openings, a
    /// permutation drawn from the seed and the round (Fisher–Yates) for every revisit.
    pub fn order(&self, round: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.conversations).collect();
        if round == 0 {
            return order;
        }
        let mut s = Stream::new(self.seed, ORDER, round, 0);
        for i in (1..order.len()).rev() {
            let j = (s.next() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        order
    }

    /// A conversation's history after its last round: every prompt and answer.
    pub fn final_history_tokens(&self) -> usize {
        if self.rounds == 0 {
            return 0;
        }
        self.first_tokens + (self.rounds - 1) * self.turn_tokens + self.rounds * self.answer_tokens
    }

    /// The working set: the final histories of all conversations together.
    pub fn working_set_tokens(&self) -> usize {
        self.conversations * self.final_history_tokens()
    }

    /// The uncounted warm-up prompt: as long as an opening, sharing no tokens with the workload.
    pub fn warm_up(&self) -> Vec<u32> {
        self.ids(WARM_UP, 0, 0, self.first_tokens.max(1))
    }
}

/// The salt every request of run `run` carries, unless the user gives one: new for every run, so
/// that no earlier run's cache can help.
pub(crate) fn run_salt(run: &str) -> String {
    format!("bench-revisit-{run}")
}

/// The warm-up's salt: shared with nothing, so it warms the cluster without seeding the cache.
pub(crate) fn warm_up_salt(run: &str) -> String {
    format!("bench-revisit-warm-{run}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn shape() -> Shape {
        Shape {
            conversations: 24,
            rounds: 4,
            first_tokens: 64,
            turn_tokens: 8,
            answer_tokens: 5,
            vocab_limit: 256,
            seed: 7,
        }
    }

    /// A stand-in for the answer the cluster would generate.
    fn answer(s: &Shape, conv: usize, round: usize) -> Vec<u32> {
        (0..s.answer_tokens as u32).map(|k| 1000 + 100 * conv as u32 + 10 * round as u32 + k).collect()
    }

    #[test]
    fn a_revisit_is_the_whole_history_then_new_tokens() {
        let s = shape();
        for conv in 0..s.conversations {
            let mut prompt = s.opening(conv);
            assert_eq!(prompt.len(), s.first_tokens);
            for round in 1..s.rounds {
                let mut history = prompt.clone();
                history.extend(answer(&s, conv, round - 1));
                let next = s.revisit(conv, round, &history);
                assert_eq!(&next[..history.len()], &history[..], "round {round} starts with the history");
                assert_eq!(&next[history.len()..], &s.turn(conv, round)[..], "then the new tokens");
                // Every earlier prompt is a prefix: the cache can serve all of it.
                assert_eq!(&next[..prompt.len()], &prompt[..]);
                prompt = next;
            }
            let mut history = prompt;
            history.extend(answer(&s, conv, s.rounds - 1));
            assert_eq!(history.len(), s.final_history_tokens());
        }
        assert_eq!(s.final_history_tokens(), 64 + 3 * 8 + 4 * 5);
        assert_eq!(s.working_set_tokens(), 24 * s.final_history_tokens());
        assert_eq!(Shape { rounds: 0, ..s }.working_set_tokens(), 0);
    }

    #[test]
    fn conversations_are_distinct_and_ids_in_range() {
        let s = Shape { vocab_limit: 50, ..shape() };
        let openings: HashSet<Vec<u32>> = (0..s.conversations).map(|c| s.opening(c)).collect();
        assert_eq!(openings.len(), s.conversations, "every conversation opens differently");
        // They differ from the first block on, so no conversation serves another from the cache.
        let heads: HashSet<Vec<u32>> = openings.iter().map(|o| o[..16].to_vec()).collect();
        assert_eq!(heads.len(), s.conversations);
        for o in &openings {
            assert!(o.iter().all(|&t| (1..50).contains(&t)), "ids in 1..vocab_limit");
        }
        assert_ne!(s.turn(0, 1), s.turn(0, 2));
        assert_ne!(s.turn(0, 1), s.turn(1, 1));
        assert_ne!(s.warm_up()[..16], s.opening(0)[..16]);
        let tiny = Shape { vocab_limit: 0, ..shape() };
        assert!(tiny.opening(0).iter().all(|&t| t == 1), "a limit below 2 still gives valid ids");
    }

    #[test]
    fn orders_are_reproducible_permutations() {
        let s = shape();
        assert_eq!(s.order(0), (0..24).collect::<Vec<_>>(), "the openings go in order");
        let mut seen = HashSet::new();
        for round in 1..s.rounds {
            let o = s.order(round);
            let mut sorted = o.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..24).collect::<Vec<_>>(), "round {round} visits each conversation once");
            assert_eq!(o, shape().order(round), "the seed names the order");
            assert_ne!(o, s.order(0), "round {round} is shuffled");
            assert!(seen.insert(o), "round {round} has an order of its own");
        }
        assert_ne!(Shape { seed: 8, ..s }.order(1), s.order(1), "another seed, another order");
        for n in [0, 1, 2] {
            let t = Shape { conversations: n, ..s };
            assert_eq!(t.order(1).len(), n);
        }
    }

    #[test]
    fn the_seed_names_the_workload_and_sizes_do_not_reseed() {
        let s = shape();
        assert_eq!(s.opening(3), shape().opening(3));
        assert_eq!(s.turn(3, 2), shape().turn(3, 2));
        let other = Shape { seed: 8, ..s };
        assert_ne!(s.opening(3), other.opening(3));
        assert_ne!(s.turn(3, 2), other.turn(3, 2));
        let longer = Shape { first_tokens: 100, ..s };
        assert_eq!(&longer.opening(3)[..64], &s.opening(3)[..]);
    }

    #[test]
    fn salts_are_one_per_run_and_the_warm_up_shares_none() {
        assert_eq!(run_salt("r1"), run_salt("r1"));
        assert_ne!(run_salt("r1"), run_salt("r2"));
        assert_ne!(warm_up_salt("r1"), run_salt("r1"));
    }
}
