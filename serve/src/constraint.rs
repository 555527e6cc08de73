//! A request's structured-output [`Constraint`] on the wire ([`OutputConstraint`]) and back: the
//! router writes it into every worker request, the workers read it, and both use these two
//! functions so the mapping exists once.

use tandem_model::grammar::Constraint;
use tandem_proto::v1::{output_constraint::Kind, Choices, OutputConstraint};

/// The wire form of `c`.
pub fn to_wire(c: &Constraint) -> OutputConstraint {
    let kind = match c {
        Constraint::JsonObject => Kind::JsonObject(true),
        Constraint::JsonSchema(s) => Kind::JsonSchema(s.clone()),
        Constraint::Regex(s) => Kind::Regex(s.clone()),
        Constraint::Choice(c) => Kind::Choice(Choices { options: c.clone() }),
        Constraint::Grammar(s) => Kind::Grammar(s.clone()),
    };
    OutputConstraint { kind: Some(kind) }
}

/// The constraint a wire message names; `None` for an absent one. A message with no kind set, or
/// `json_object: false`, is an error naming the field (a peer never sends either).
pub fn from_wire(w: Option<&OutputConstraint>) -> Result<Option<Constraint>, String> {
    let Some(w) = w else { return Ok(None) };
    Ok(Some(match &w.kind {
        None => return Err("constraint: no kind is set".into()),
        Some(Kind::JsonObject(true)) => Constraint::JsonObject,
        Some(Kind::JsonObject(false)) => return Err("constraint: json_object must be true when set".into()),
        Some(Kind::JsonSchema(s)) => Constraint::JsonSchema(s.clone()),
        Some(Kind::Regex(s)) => Constraint::Regex(s.clone()),
        Some(Kind::Choice(c)) => Constraint::Choice(c.options.clone()),
        Some(Kind::Grammar(s)) => Constraint::Grammar(s.clone()),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_survives_the_wire() {
        for c in [
            Constraint::JsonObject,
            Constraint::JsonSchema(r#"{"type":"integer"}"#.into()),
            Constraint::Regex("[ab]+".into()),
            Constraint::Choice(vec!["yes".into(), "no".into()]),
            Constraint::Grammar("start: \"x\"".into()),
        ] {
            assert_eq!(from_wire(Some(&to_wire(&c))).unwrap(), Some(c));
        }
        assert_eq!(from_wire(None).unwrap(), None);
        let empty = OutputConstraint { kind: None };
        assert!(from_wire(Some(&empty)).unwrap_err().contains("constraint"));
        let off = OutputConstraint { kind: Some(Kind::JsonObject(false)) };
        assert!(from_wire(Some(&off)).unwrap_err().contains("json_object"));
    }
}
