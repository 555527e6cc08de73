//! How a worker speculates, as the router prints it. The flags and the drafter they build belong
//! to the workers (`tandem_worker::speculation`); this is the part any process may show.

use tandem_proto::v1;

/// One line for logs and listings: `ngram 2..4, k=4, adaptive`, or `off`.
pub fn describe(info: Option<&v1::SpeculationInfo>) -> String {
    match info {
        None => "off".into(),
        Some(s) => format!(
            "{}, k={}, {}",
            if s.drafter.is_empty() { &s.method } else { &s.drafter },
            s.max_draft,
            if s.adaptive { "adaptive" } else { "fixed depth" }
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_describe_the_drafter() {
        assert_eq!(describe(None), "off");
        let s = v1::SpeculationInfo {
            method: "ngram".into(),
            max_draft: 4,
            adaptive: true,
            drafter: "ngram 2..4".into(),
        };
        assert_eq!(describe(Some(&s)), "ngram 2..4, k=4, adaptive");
    }
}
