// llama_ref: the llama.cpp side of lockstep's golden references (tools/golden/make.py builds
// it against the peer llama.cpp that bench/compare.sh builds, and runs it).
//
// usage:
//   llama_ref generate MODEL PROMPTS.json OUT.json [--no-bos] [--threads N]
//       PROMPTS.json: [{"name", "text", "n"}]; for each prompt: the text tokenized as llama.cpp
//       tokenizes a raw prompt (control tokens in the text parsed; BOS added exactly when the
//       model's `tokenizer.ggml.add_bos_token` asks for it, never with --no-bos), then greedy
//       decoding of up to n tokens (stopping after an end-of-generation token): the prompt in
//       batches of n_batch (2048, ubatches of 512), then one token per llama_decode, as
//       llama-server does. Every generated token is reported with the natural-log softmax
//       (f64, over the full vocabulary, temperature 1) of its own id and of the five best ids.
//       OUT.json: {"add_bos", "cases": [{"name", "text", "prompt_tokens", "completion_tokens",
//       "completion_text", "steps": [{"id", "logprob", "top": [[id, logprob] x5]}]}]}
//   llama_ref tokenize MODEL STRINGS.json OUT.json
//       STRINGS.json: ["text", ...]; OUT.json: [[ids], ...], each text tokenized without BOS,
//       control tokens in the text parsed.
//
// Context: n_ctx 4096, KV f16, flash attention auto, 2 threads (llama.cpp's CPU results do not
// depend on the thread count, tools/numerics/FINDINGS.md), llama.cpp's defaults otherwise.
#include "llama.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

using json = nlohmann::ordered_json;

static void die(const std::string &msg) {
    fprintf(stderr, "llama_ref: error: %s\n", msg.c_str());
    exit(1);
}

static json read_json(const char *path) {
    std::ifstream in(path);
    if (!in) die(std::string("cannot read ") + path);
    return json::parse(in);
}

static void write_json(const char *path, const json &v) {
    std::ofstream out(path);
    if (!out) die(std::string("cannot write ") + path);
    out << v.dump() << "\n";
}

static std::vector<llama_token> tokenize(const llama_vocab *vocab, const std::string &text, bool add_special) {
    int n = -llama_tokenize(vocab, text.data(), (int32_t)text.size(), nullptr, 0, add_special, true);
    std::vector<llama_token> ids(std::max(n, 0));
    int got = llama_tokenize(vocab, text.data(), (int32_t)text.size(), ids.data(), (int32_t)ids.size(),
                             add_special, true);
    if (got < 0) die("tokenization failed for: " + text);
    ids.resize(got);
    return ids;
}

static std::string piece(const llama_vocab *vocab, llama_token t) {
    char buf[512];
    int n = llama_token_to_piece(vocab, t, buf, sizeof buf, 0, false);
    if (n < 0) die("token piece too long");
    return std::string(buf, n);
}

static json step_of(const float *logits, int n_vocab, llama_token chosen) {
    double mx = -INFINITY;
    for (int i = 0; i < n_vocab; i++) mx = std::max(mx, (double)logits[i]);
    double sum = 0;
    for (int i = 0; i < n_vocab; i++) sum += std::exp((double)logits[i] - mx);
    const double lse = mx + std::log(sum);
    std::vector<int> order(n_vocab);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 5, order.end(), [&](int a, int b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    json top = json::array();
    for (int k = 0; k < 5; k++) top.push_back({order[k], (double)logits[order[k]] - lse});
    return {{"id", chosen}, {"logprob", (double)logits[chosen] - lse}, {"top", top}};
}

static int generate(llama_model *model, const char *prompts_path, const char *out_path, bool no_bos, int threads) {
    const llama_vocab *vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    const bool add_bos = llama_vocab_get_add_bos(vocab) && !no_bos;
    const int n_batch = 2048, n_ubatch = 512;
    json cases = json::array();
    for (const auto &p : read_json(prompts_path)) {
        const std::string name = p.at("name"), text = p.at("text");
        const int n_predict = p.at("n");
        auto prompt = tokenize(vocab, text, add_bos);
        auto cp = llama_context_default_params();
        cp.n_ctx = 4096;
        cp.n_batch = n_batch;
        cp.n_ubatch = n_ubatch;
        cp.n_threads = cp.n_threads_batch = threads;
        if ((int)prompt.size() + n_predict > (int)cp.n_ctx) die(name + ": prompt too long");
        llama_context *ctx = llama_init_from_model(model, cp);
        if (!ctx) die("cannot create a context");
        llama_batch b = llama_batch_init(n_batch, 0, 1);
        auto decode = [&](const std::vector<llama_token> &toks, int pos0) {
            // In batches of n_batch, logits for the last token only.
            for (size_t at = 0; at < toks.size(); at += n_batch) {
                int chunk = (int)std::min(toks.size() - at, (size_t)n_batch);
                b.n_tokens = chunk;
                for (int j = 0; j < chunk; j++) {
                    b.token[j] = toks[at + j];
                    b.pos[j] = pos0 + (int)at + j;
                    b.n_seq_id[j] = 1;
                    b.seq_id[j][0] = 0;
                    b.logits[j] = at + j + 1 == toks.size();
                }
                if (llama_decode(ctx, b)) die(name + ": llama_decode failed");
            }
            return llama_get_logits_ith(ctx, -1);
        };
        const float *logits = decode(prompt, 0);
        std::vector<llama_token> completion;
        std::string completion_text;
        json steps = json::array();
        for (int i = 0; i < n_predict; i++) {
            llama_token best = (llama_token)(std::max_element(logits, logits + n_vocab) - logits);
            steps.push_back(step_of(logits, n_vocab, best));
            completion.push_back(best);
            completion_text += piece(vocab, best);
            if (llama_vocab_is_eog(vocab, best) || i + 1 == n_predict) break;
            logits = decode({best}, (int)(prompt.size() + completion.size() - 1));
        }
        llama_batch_free(b);
        llama_free(ctx);
        cases.push_back({{"name", name},
                         {"text", text},
                         {"prompt_tokens", prompt},
                         {"completion_tokens", completion},
                         {"completion_text", completion_text},
                         {"steps", steps}});
        fprintf(stderr, "llama_ref: %s: %zu prompt tokens, %zu generated\n", name.c_str(), prompt.size(),
                completion.size());
    }
    write_json(out_path, {{"add_bos", add_bos}, {"cases", cases}});
    return 0;
}

static int tokenize_all(llama_model *model, const char *strings_path, const char *out_path) {
    const llama_vocab *vocab = llama_model_get_vocab(model);
    json out = json::array();
    for (const auto &s : read_json(strings_path)) out.push_back(tokenize(vocab, s.get<std::string>(), false));
    write_json(out_path, out);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: llama_ref generate|tokenize MODEL IN.json OUT.json [--no-bos] [--threads N]\n");
        return 2;
    }
    const std::string mode = argv[1];
    bool no_bos = false;
    int threads = 2;
    for (int i = 5; i < argc; i++) {
        const std::string a = argv[i];
        if (a == "--no-bos") no_bos = true;
        else if (a == "--threads" && i + 1 < argc) threads = atoi(argv[++i]);
        else die("unknown argument " + a);
    }
    llama_backend_init();
    if (!getenv("LLAMA_REF_LOG")) llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    auto mp = llama_model_default_params();
    mp.vocab_only = mode == "tokenize";
    llama_model *model = llama_model_load_from_file(argv[2], mp);
    if (!model) die(std::string("cannot load ") + argv[2]);
    int rc = mode == "generate"   ? generate(model, argv[3], argv[4], no_bos, threads)
             : mode == "tokenize" ? tokenize_all(model, argv[3], argv[4])
                                  : (die("unknown mode " + mode), 2);
    llama_model_free(model);
    llama_backend_free();
    return rc;
}
