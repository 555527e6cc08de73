//! Anthropic's Messages API through the official `anthropic` Python package, against a real
//! `tandem up` on the default model (SmolLM2, whose template has no tool format: tools take the
//! generic one) started with an API key: plain and streamed messages, a stop sequence, a forced
//! tool call whose input `jsonschema` validates and an agent's loop that hands its result back,
//! `count_tokens` equal to the prompt the messages ran, and refusals as the package's error
//! classes (see `tests/e2e/py/anthropic_client.py`).
//!
//! Skips with a message when `TANDEM_PYTHON` is unset or the model is missing, unless
//! `TANDEM_REQUIRE_EXTERNAL=1` / `TANDEM_REQUIRE_MODEL=1`.

use std::time::Duration;

use tandem_e2e::*;

#[test]
fn anthropic_package_talks_to_the_messages_api() {
    let test = "anthropic_package_talks_to_the_messages_api";
    let Some(model) = default_model_for_test(test) else { return };
    let Some(python) = external_python(test) else { return };
    let key = format!("test-key-{}", rand::random::<u64>());
    let (mut up, ready) = start_up_on(&model, &["--api-key", &key]);
    let http = ready.http.unwrap_or_else(|| panic!("no http address:\n{}", up.log_tail(4000)));

    let args = [format!("http://{http}"), "--api-key".into(), key];
    let s = run_py_json(&python, "anthropic_client.py", &args, Duration::from_secs(600));

    assert!(!s["text"].as_str().unwrap_or("").trim().is_empty(), "{s}");
    assert_eq!(s["stream"]["text"], s["text"], "streamed and greedy answers differ: {s}");
    let stop = s["stop_sequence"]["stop"].as_str().unwrap();
    assert!(!s["stop_sequence"]["text"].as_str().unwrap().contains(stop), "{s}");

    // count_tokens gives the prompt's whole length: computed plus read from the prefix cache.
    let usage = &s["usage"];
    let prompt =
        usage["input_tokens"].as_u64().unwrap() + usage["cache_read_input_tokens"].as_u64().unwrap_or(0);
    assert_eq!(s["count_tokens"].as_u64(), Some(prompt), "{s}");

    let tools = &s["tools"];
    assert_eq!(tools["call"]["name"], "get_weather", "{s}");
    let input = tools["call"]["input"].as_object().unwrap_or_else(|| panic!("input is not an object: {s}"));
    assert!(input["city"].is_string(), "{s}");
    assert!(matches!(input["unit"].as_str(), Some("celsius" | "fahrenheit")), "{s}");
    assert!(tools["count_tokens"].as_u64().unwrap() > prompt, "the tools are described in the prompt: {s}");
    assert!(tools["answer_tokens"].as_u64().unwrap() > 0, "{s}");

    let errors = &s["errors"];
    assert_eq!(errors["model"], "not_found_error", "{s}");
    assert_eq!(errors["auth"], "authentication_error", "{s}");
    assert_eq!(errors["x_api_key"], 200, "{s}");
    let starts = |k: &str, field: &str| errors[k].as_str().is_some_and(|m| m.starts_with(field));
    assert!(starts("max_tokens", "max_tokens:"), "{s}");
    assert!(
        starts("tool_choice", "tool_choice.name:") && errors["tool_choice"].as_str().unwrap().contains("fly")
    );
    assert!(starts("image", "messages[0].content[0]:"), "{s}");
    assert!(s["model"].as_str().is_some_and(|m| !m.is_empty()), "{s}");

    up.signal(libc::SIGTERM);
    let st = up
        .wait_exit(Duration::from_secs(90))
        .unwrap_or_else(|| panic!("tandem up did not stop:\n{}", up.log_tail(4000)));
    assert!(st.success(), "tandem up exited with {st}:\n{}", up.log_tail(4000));
}
