//! Bad model files fail with errors that name the file and the tensor or setting at fault.

use std::path::{Path, PathBuf};

use tandem_engine::loader::load_model;
use tandem_engine::EngineError;

fn copy_fixture(name: &str, tag: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures").join(name);
    let dst = std::env::temp_dir().join(format!("tandem-loader-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

fn load_err(dir: &Path) -> EngineError {
    match load_model(dir) {
        Ok(_) => panic!("{} loaded although it is broken", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn wrong_shape_names_file_and_tensor() {
    let dir = copy_fixture("llama-gqa", "shape");
    edit_config(&dir, |v| v["intermediate_size"] = serde_json::json!(100));
    let e = load_err(&dir);
    assert_eq!(e.kind(), "shape");
    let msg = e.to_string();
    assert!(msg.contains("model.safetensors") && msg.contains("mlp.gate_proj.weight"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn missing_shard_and_missing_tensor_are_named() {
    let dir = copy_fixture("llama3-rope-scaled", "shard");
    std::fs::remove_file(dir.join("model-00002-of-00005.safetensors")).unwrap();
    let e = load_err(&dir);
    assert!(e.to_string().contains("model-00002-of-00005.safetensors"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();

    // Untie the embeddings of a model that has no lm_head tensor.
    let dir = copy_fixture("qwen3", "tensor");
    edit_config(&dir, |v| v["tie_word_embeddings"] = serde_json::json!(false));
    let e = load_err(&dir);
    assert_eq!(e.kind(), "missing_tensor");
    assert!(e.to_string().contains("lm_head.weight"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unsupported_architecture_names_the_file() {
    let dir = copy_fixture("mistral", "arch");
    edit_config(&dir, |v| {
        v["model_type"] = serde_json::json!("gpt_neox");
        v["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"]);
    });
    let e = load_err(&dir);
    assert_eq!(e.kind(), "unsupported");
    assert!(e.to_string().contains("config.json") && e.to_string().contains("GPTNeoXForCausalLM"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn truncated_weights_and_missing_paths_are_errors() {
    let dir = copy_fixture("llama-gqa", "trunc");
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(&dir);
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();

    let e = load_err(Path::new("/nonexistent/model.gguf"));
    assert_eq!(e.kind(), "io");
    assert!(e.to_string().contains("/nonexistent/model.gguf"), "{e}");
}
