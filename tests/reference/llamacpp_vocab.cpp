// Tokenizes and detokenizes with llama.cpp's own vocabulary code, for the reference fixtures.
//
// Usage: llamacpp_vocab MODEL.gguf < requests > answers
//
// Loads only the vocabulary (vocab_only) and answers one line per request line. Text travels as
// lowercase hex of its UTF-8 bytes ("-" for empty), so any byte survives the pipe.
//   E <hex>       -> "ids <id> <id> ..."   llama_tokenize(add_special = true,  parse_special = true)
//   N <hex>       -> "ids <id> <id> ..."   llama_tokenize(add_special = false, parse_special = true)
//   D <id> <id>.. -> "dec <hex> <hex>"     llama_detokenize(remove_special = false, unparse_special = true),
//                                          then (remove_special = true, unparse_special = false)
//   P <id>        -> "piece <hex>"         llama_token_to_piece(lstrip = 0, special = true)
// LLAMACPP_VOCAB_LOG=1 keeps llama.cpp's log on stderr. Before the first answer it prints "info <n_vocab> <bos> <eos> <add_bos> <add_eos>" and
// "eog <id> ...", every id llama_vocab_is_eog accepts.
//
// Build against a llama.cpp build tree (see tests/reference/README.md):
//   g++ -std=c++17 -O1 -I SRC/include -I SRC/ggml/include tests/reference/llamacpp_vocab.cpp \
//       -L BUILD/bin -lllama -lggml -lggml-base -Wl,-rpath,BUILD/bin -o llamacpp_vocab

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

static std::string to_hex(const std::string & s) {
    if (s.empty()) {
        return "-";
    }
    static const char * digits = "0123456789abcdef";
    std::string out;
    for (unsigned char c : s) {
        out += digits[c >> 4];
        out += digits[c & 15];
    }
    return out;
}

static std::string from_hex(const std::string & h) {
    std::string out;
    if (h == "-") {
        return out;
    }
    for (size_t i = 0; i + 1 < h.size(); i += 2) {
        out += (char) std::stoi(h.substr(i, 2), nullptr, 16);
    }
    return out;
}

static std::string ids_line(const llama_vocab * vocab, const std::string & text, bool add_special) {
    std::vector<llama_token> ids(text.size() + 8);
    int n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), add_special, true);
    if (n < 0) {
        ids.resize(-n);
        n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), add_special, true);
    }
    std::string out = "ids";
    for (int i = 0; i < n; i++) {
        out += " " + std::to_string(ids[i]);
    }
    return out;
}

static std::string detok(const llama_vocab * vocab, const std::vector<llama_token> & ids, bool remove, bool unparse) {
    std::string buf(ids.size() * 16 + 16, '\0');
    int n = llama_detokenize(vocab, ids.data(), (int) ids.size(), &buf[0], (int) buf.size(), remove, unparse);
    if (n < 0) {
        buf.resize(-n);
        n = llama_detokenize(vocab, ids.data(), (int) ids.size(), &buf[0], (int) buf.size(), remove, unparse);
    }
    buf.resize(n);
    return buf;
}

static void quiet(ggml_log_level, const char *, void *) {}

int main(int argc, char ** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL.gguf\n", argv[0]);
        return 2;
    }
    if (!getenv("LLAMACPP_VOCAB_LOG")) {
        llama_log_set(quiet, nullptr);
    }
    llama_backend_init();
    llama_model_params params = llama_model_default_params();
    params.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], params);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    std::cout << "info " << n_vocab << " " << llama_vocab_bos(vocab) << " " << llama_vocab_eos(vocab) << " "
              << llama_vocab_get_add_bos(vocab) << " " << llama_vocab_get_add_eos(vocab) << "\n";
    std::cout << "eog";
    for (llama_token id = 0; id < n_vocab; id++) {
        if (llama_vocab_is_eog(vocab, id)) {
            std::cout << " " << id;
        }
    }
    std::cout << "\n";

    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string op;
        in >> op;
        if (op == "E" || op == "N") {
            std::string hex;
            in >> hex;
            std::cout << ids_line(vocab, from_hex(hex), op == "E") << "\n";
        } else if (op == "D") {
            std::vector<llama_token> ids;
            llama_token id;
            while (in >> id) {
                ids.push_back(id);
            }
            std::cout << "dec " << to_hex(detok(vocab, ids, false, true)) << " " << to_hex(detok(vocab, ids, true, false))
                      << "\n";
        } else if (op == "P") {
            llama_token id;
            in >> id;
            char buf[256];
            int n = llama_token_to_piece(vocab, id, buf, sizeof(buf), 0, true);
            std::cout << "piece " << to_hex(std::string(buf, n > 0 ? n : 0)) << "\n";
        } else {
            fprintf(stderr, "unknown request: %s\n", line.c_str());
            return 1;
        }
        std::cout.flush();
    }
    llama_model_free(model);
    return 0;
}
