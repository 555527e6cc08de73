//! OpenAI's Responses API through the official `openai` Python package, against `tandem up` on the
//! default model (SmolLM2, whose chat template has no tool-call format: tools take the generic
//! one). One cluster, one run of `tests/e2e/py/responses_client.py`, which checks every object and
//! event as the package parses them (plain and streamed answers, a forced function call whose
//! result is handed back with `previous_response_id`, structured output judged by `jsonschema`,
//! retrieve and delete, refusals); here the summary it prints is checked.
//!
//! Skips with a message when `TANDEM_PYTHON` is unset, unless `TANDEM_REQUIRE_EXTERNAL=1`.

use std::time::Duration;

use serde_json::Value;
use tandem_e2e::*;

#[test]
fn responses_api_through_the_openai_package() {
    let test = "responses_api_through_the_openai_package";
    let Some(model) = default_model_for_test(test) else { return };
    let Some(python) = external_python(test) else { return };
    let args =
        ["up".to_string(), "--model".into(), model.display().to_string(), "--threads".into(), "1".into()];
    let mut up = Proc::spawn("up", &bin("tandem"), &args);
    let line = up
        .next_line(Duration::from_secs(300))
        .unwrap_or_else(|| panic!("no ready line:\n{}", up.log_tail(4000)));
    let ready = parse_ready(&line)
        .unwrap_or_else(|| panic!("unexpected first line {line:?}:\n{}", up.log_tail(4000)));
    let http = ready.http.unwrap_or_else(|| panic!("the ready line names no http address: {line:?}"));

    let s =
        run_py_json(&python, "responses_client.py", &[format!("http://{http}/v1")], Duration::from_secs(600));
    println!("{s}");
    let str_of = |v: &Value| v.as_str().unwrap_or_else(|| panic!("not a string: {v} in {s}")).to_owned();

    assert!(!str_of(&s["plain"]["text"]).trim().is_empty(), "{s}");
    assert!(s["streamed"]["deltas"].as_u64().unwrap_or(0) >= 2, "{s}");
    let call = &s["function_call"]["call"];
    assert_eq!(call["name"], "get_weather", "{s}");
    assert!(call["arguments"]["city"].is_string(), "{s}");
    assert!(["celsius", "fahrenheit"].contains(&str_of(&call["arguments"]["unit"]).as_str()), "{s}");
    assert!(!str_of(&s["function_call"]["answer"]).trim().is_empty(), "{s}");
    let tokens = s["function_call"]["input_tokens"].as_array().unwrap();
    assert!(
        tokens[1].as_u64() > tokens[0].as_u64(),
        "the continuation carried the conversation (question alone, continuation): {s}"
    );
    assert!(s["structured"]["json_schema"]["age"].is_u64(), "{s}");
    assert!(s["structured"]["parsed"]["name"].is_string(), "{s}");
    assert!(str_of(&s["stored"]["deleted"]).contains("not held by this router"), "{s}");
    assert!(str_of(&s["stored"]["unknown_previous"]).contains("resp_unknown"), "{s}");
    assert!(str_of(&s["refused"]).contains("tools[0].type"), "{s}");

    up.signal(libc::SIGTERM);
    let st = up
        .wait_exit(Duration::from_secs(90))
        .unwrap_or_else(|| panic!("tandem up did not stop:\n{}", up.log_tail(4000)));
    assert!(st.success(), "tandem up exited with {st}:\n{}", up.log_tail(4000));
}
