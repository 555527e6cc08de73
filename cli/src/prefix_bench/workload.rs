//! The shared-prefix workload as token ids: pure, no I/O (the runner supplies the answers a chat
//! continues with).
//!
//! Two parts:
//! - *system prompt*: `requests` prompts, each the one `system_tokens`-long system prompt followed by
//!   a `question_tokens`-long question of its own;
//! - *chats*: `chats` conversations of `turns` turns. Turn 0's prompt is an opening message of
//!   `question_tokens`; turn t+1's prompt is turn t's prompt, then the tokens generated for it, then
//!   a new message of `question_tokens`. Chats do not start with the system prompt, so what they
//!   reuse is their own earlier turns.
//!
//! Invariants: every piece (system prompt, question, message, warm-up prompt) is a pure function of
//! the seed and the piece's name, so a seed names one workload; ids lie in `1..vocab_limit` (0 is
//! often a special token); salts of the cache-off phase are unique per request and run, the
//! cache-on phase has one salt per run.

use std::fmt;

/// The sizes of the workload and where its token ids come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Shape {
    /// Tokens of the system prompt every system-prompt request starts with.
    pub system_tokens: usize,
    /// Tokens of each question, and of each user message of a chat.
    pub question_tokens: usize,
    /// System-prompt requests.
    pub requests: usize,
    pub chats: usize,
    pub turns: usize,
    /// Tokens generated per request.
    pub answer_tokens: usize,
    /// Token ids are drawn below this.
    pub vocab_limit: u32,
    pub seed: u64,
}

/// One request of a phase, named the same way in both phases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum RequestKey {
    /// System-prompt request `i`.
    System(usize),
    /// Turn `turn` of chat `chat`.
    Chat { chat: usize, turn: usize },
}

impl fmt::Display for RequestKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestKey::System(i) => write!(f, "s{i}"),
            RequestKey::Chat { chat, turn } => write!(f, "c{chat}t{turn}"),
        }
    }
}

/// Cache off (the baseline: nothing can be shared) or cache on (everything can).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Phase {
    Off,
    On,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Off => "off",
            Phase::On => "on",
        })
    }
}

impl Phase {
    /// The `cache_salt` of request `key` in run `run`: its own with the cache off, the run's with
    /// the cache on. The run id keeps an earlier run's cache from helping.
    pub fn salt(self, run: &str, key: RequestKey) -> String {
        match self {
            Phase::Off => format!("bench-off-{run}-{key}"),
            Phase::On => format!("bench-on-{run}"),
        }
    }

    /// The salt of the phase's uncounted warm-up request: shared with nothing, so the warm-up
    /// warms the cluster without seeding the cache the phase measures.
    pub fn warm_up_salt(self, run: &str) -> String {
        format!("bench-warm-{run}-{self}")
    }
}

/// Names of the pieces, so each draws its own stream of ids from the seed.
const SYSTEM: u64 = 1;
const QUESTION: u64 = 2;
const MESSAGE: u64 = 3;
const WARM_UP: u64 = 4;

/// SplitMix64's output function: a bijection that scatters nearby inputs.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Shape {
    /// `n` ids below `vocab_limit` (and above 0) for piece `piece`, index `a`, `b`.
    fn ids(&self, piece: u64, a: usize, b: usize, n: usize) -> Vec<u32> {
        const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut x =
            mix(mix(mix(self.seed ^ piece.wrapping_mul(GAMMA)) ^ a as u64) ^ (b as u64).rotate_left(32));
        let span = u64::from(self.vocab_limit.max(2)) - 1;
        (0..n)
            .map(|_| {
                x = x.wrapping_add(GAMMA);
                1 + (mix(x) % span) as u32
            })
            .collect()
    }

    /// The system prompt every system-prompt request starts with.
    pub fn system_prompt(&self) -> Vec<u32> {
        self.ids(SYSTEM, 0, 0, self.system_tokens)
    }

    /// System-prompt request `i`'s question.
    pub fn question(&self, i: usize) -> Vec<u32> {
        self.ids(QUESTION, i, 0, self.question_tokens)
    }

    /// System-prompt request `i`: the system prompt, then its question.
    pub fn system_request(&self, system_prompt: &[u32], i: usize) -> Vec<u32> {
        let mut p = system_prompt.to_vec();
        p.extend(self.question(i));
        p
    }

    /// The user message that opens turn `turn` of chat `chat`.
    pub fn message(&self, chat: usize, turn: usize) -> Vec<u32> {
        self.ids(MESSAGE, chat, turn, self.question_tokens)
    }

    /// Turn 0's prompt of chat `chat`.
    pub fn first_turn(&self, chat: usize) -> Vec<u32> {
        self.message(chat, 0)
    }

    /// Turn `turn`'s prompt (`turn` ≥ 1) of chat `chat`: the previous turn's prompt, the answer
    /// generated for it, and a new message.
    pub fn next_turn(&self, chat: usize, turn: usize, previous: &[u32], answer: &[u32]) -> Vec<u32> {
        let mut p = Vec::with_capacity(previous.len() + answer.len() + self.question_tokens);
        p.extend_from_slice(previous);
        p.extend_from_slice(answer);
        p.extend(self.message(chat, turn));
        p
    }

    /// A phase's warm-up prompt: as long as a system-prompt request, sharing no tokens with it.
    pub fn warm_up(&self, phase: Phase) -> Vec<u32> {
        self.ids(WARM_UP, phase as usize, 0, (self.system_tokens + self.question_tokens).max(1))
    }

    /// Requests per phase, both parts.
    pub fn total_requests(&self) -> usize {
        self.requests + self.chats * self.turns
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn shape() -> Shape {
        Shape {
            system_tokens: 100,
            question_tokens: 12,
            requests: 16,
            chats: 3,
            turns: 4,
            answer_tokens: 5,
            vocab_limit: 256,
            seed: 7,
        }
    }

    #[test]
    fn system_prompt_is_shared_and_questions_are_distinct() {
        let s = shape();
        let sys = s.system_prompt();
        assert_eq!(sys.len(), 100);
        let prompts: Vec<Vec<u32>> = (0..s.requests).map(|i| s.system_request(&sys, i)).collect();
        for (i, p) in prompts.iter().enumerate() {
            assert_eq!(p.len(), 112);
            assert_eq!(&p[..100], &sys[..], "request {i} starts with the system prompt");
            assert_eq!(&p[100..], &s.question(i)[..]);
        }
        let questions: HashSet<Vec<u32>> = prompts.iter().map(|p| p[100..].to_vec()).collect();
        assert_eq!(questions.len(), s.requests, "every question is different");
        // Most questions differ from their first token on, so what the prompts share is the system
        // prompt and hardly more.
        let firsts: HashSet<u32> = prompts.iter().map(|p| p[100]).collect();
        assert!(firsts.len() > s.requests / 2, "{firsts:?}");
        // The system prompt is not one of the questions' streams.
        assert_ne!(&sys[..12], &s.question(0)[..]);
    }

    #[test]
    fn ids_stay_in_range_and_vary() {
        let s = Shape { vocab_limit: 50, system_tokens: 2000, ..shape() };
        let sys = s.system_prompt();
        assert!(sys.iter().all(|&t| (1..50).contains(&t)), "ids in 1..vocab_limit");
        let distinct: HashSet<u32> = sys.iter().copied().collect();
        assert_eq!(distinct.len(), 49, "2,000 draws cover all 49 ids");
        let tiny = Shape { vocab_limit: 0, ..shape() };
        assert!(tiny.system_prompt().iter().all(|&t| t == 1), "a limit below 2 still gives valid ids");
    }

    #[test]
    fn the_seed_names_the_workload() {
        let (a, b) = (shape(), shape());
        assert_eq!(a.system_prompt(), b.system_prompt());
        assert_eq!(a.question(3), b.question(3));
        assert_eq!(a.message(2, 1), b.message(2, 1));
        let other = Shape { seed: 8, ..shape() };
        assert_ne!(a.system_prompt(), other.system_prompt());
        assert_ne!(a.question(3), other.question(3));
        assert_ne!(a.message(2, 1), other.message(2, 1));
        // Sizes do not reseed: a longer system prompt starts with the shorter one.
        let longer = Shape { system_tokens: 150, ..shape() };
        assert_eq!(&longer.system_prompt()[..100], &a.system_prompt()[..]);
    }

    #[test]
    fn chat_turns_extend_the_previous_prompt_and_answer() {
        let s = shape();
        let mut seen = HashSet::new();
        for chat in 0..s.chats {
            let mut prompt = s.first_turn(chat);
            assert_eq!(prompt.len(), s.question_tokens);
            assert!(seen.insert(prompt.clone()), "chats open with different messages");
            for turn in 1..s.turns {
                let answer: Vec<u32> = (0..s.answer_tokens as u32).map(|k| 1000 + k + turn as u32).collect();
                let next = s.next_turn(chat, turn, &prompt, &answer);
                assert_eq!(
                    &next[..prompt.len()],
                    &prompt[..],
                    "turn {turn} starts with turn {}'s prompt",
                    turn - 1
                );
                assert_eq!(&next[prompt.len()..prompt.len() + answer.len()], &answer[..], "then its answer");
                let message = &next[prompt.len() + answer.len()..];
                assert_eq!(message, &s.message(chat, turn)[..], "then a new message");
                assert!(seen.insert(message.to_vec()), "every message is new");
                prompt = next;
            }
            assert_eq!(prompt.len(), s.turns * s.question_tokens + (s.turns - 1) * s.answer_tokens);
        }
    }

    #[test]
    fn salts_are_unique_with_the_cache_off_and_one_per_run_with_it_on() {
        let s = shape();
        let keys: Vec<RequestKey> = (0..s.requests)
            .map(RequestKey::System)
            .chain(
                (0..s.chats).flat_map(|chat| (0..s.turns).map(move |turn| RequestKey::Chat { chat, turn })),
            )
            .collect();
        assert_eq!(keys.len(), s.total_requests());
        let off: HashSet<String> = keys.iter().map(|&k| Phase::Off.salt("r1", k)).collect();
        assert_eq!(off.len(), keys.len(), "a salt of its own per request");
        let on: HashSet<String> = keys.iter().map(|&k| Phase::On.salt("r1", k)).collect();
        assert_eq!(on, HashSet::from(["bench-on-r1".to_string()]));
        // A new run shares nothing with an earlier one, and warm-ups share with nobody.
        assert_ne!(Phase::On.salt("r2", keys[0]), Phase::On.salt("r1", keys[0]));
        assert!(off.iter().all(|s| !s.contains("r2")));
        for p in [Phase::Off, Phase::On] {
            let w = p.warm_up_salt("r1");
            assert!(!off.contains(&w) && !on.contains(&w), "{w}");
        }
        assert_ne!(Phase::Off.warm_up_salt("r1"), Phase::On.warm_up_salt("r1"));
    }

    #[test]
    fn warm_up_prompts_share_no_prefix_with_the_workload() {
        let s = shape();
        let sys = s.system_prompt();
        for p in [Phase::Off, Phase::On] {
            let w = s.warm_up(p);
            assert_eq!(w.len(), 112);
            assert_ne!(w[..16], sys[..16]);
        }
        assert_ne!(s.warm_up(Phase::Off), s.warm_up(Phase::On));
    }
}
