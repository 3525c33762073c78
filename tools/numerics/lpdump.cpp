// lpdump: teacher-forced log-probs from llama.cpp for golden cases.
// usage: lpdump MODEL CASES OUT [--fa -1|0|1] [--kv f16|f32] [--threads N] [--batch N]
//        [--ubatch N] [--mode gen|tf] [--norepack]
// CASES: text file from mkcases.py, per case 5 lines: name / prompt ids / generated ids /
// index in generated of each reported step / ref top-5 ids per step (5*n_steps ids).
// OUT: per case per step one line: case step lp0..lp4 (natural log, f64 log-softmax)
#include "llama.h"
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static std::vector<int> ids_line(std::istream &in) {
    std::string l; std::getline(in, l); std::istringstream s(l); std::vector<int> v; int x;
    while (s >> x) v.push_back(x);
    return v;
}

int main(int argc, char **argv) {
    if (argc < 4) { fprintf(stderr, "usage\n"); return 1; }
    int fa = -1, threads = 2, nbatch = 2048, nubatch = 512; bool f32kv = false, tf = false, norepack = false;
    for (int i = 4; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--fa") fa = atoi(argv[++i]);
        else if (a == "--kv") f32kv = std::string(argv[++i]) == "f32";
        else if (a == "--threads") threads = atoi(argv[++i]);
        else if (a == "--batch") nbatch = atoi(argv[++i]);
        else if (a == "--ubatch") nubatch = atoi(argv[++i]);
        else if (a == "--mode") tf = std::string(argv[++i]) == "tf";
        else if (a == "--norepack") norepack = true;
        else { fprintf(stderr, "bad arg %s\n", a.c_str()); return 1; }
    }
    llama_backend_init();
    if (!getenv("LPDUMP_LOG")) llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    auto mp = llama_model_default_params();
    if (norepack) mp.use_extra_bufts = false;
    llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::ifstream in(argv[2]);
    FILE *out = fopen(argv[3], "w");
    std::string name;
    while (std::getline(in, name)) {
        if (name.empty()) break;
        auto prompt = ids_line(in), comp = ids_line(in), sidx = ids_line(in), top = ids_line(in);
        int nsteps = top.size() / 5; int ngen = comp.size();
        auto cp = llama_context_default_params();
        cp.n_ctx = 4096; cp.n_batch = nbatch; cp.n_ubatch = nubatch;
        cp.n_threads = threads; cp.n_threads_batch = threads;
        cp.flash_attn_type = (llama_flash_attn_type)fa;
        cp.type_k = cp.type_v = f32kv ? GGML_TYPE_F32 : GGML_TYPE_F16;
        llama_context *ctx = llama_init_from_model(model, cp);
        std::vector<int> seq = prompt; seq.insert(seq.end(), comp.begin(), comp.end());
        int np = prompt.size();
        // want logits at positions np-1 .. np-1+nsteps-1
        std::vector<std::vector<float>> lg;
        llama_batch b = llama_batch_init(nbatch, 0, 1);
        int pos = 0, end = np - 1 + ngen;
        while (pos < end) {
            int chunk = tf ? nbatch : (pos < np ? std::min(nbatch, np - pos) : 1);
            chunk = std::min(chunk, end - pos);
            b.n_tokens = chunk;
            for (int j = 0; j < chunk; j++) {
                b.token[j] = seq[pos + j]; b.pos[j] = pos + j; b.n_seq_id[j] = 1; b.seq_id[j][0] = 0;
                b.logits[j] = (pos + j >= np - 1);
            }
            if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 1; }
            for (int j = 0; j < chunk; j++) if (pos + j >= np - 1) {
                float *l = llama_get_logits_ith(ctx, j);
                lg.emplace_back(l, l + n_vocab);
            }
            pos += chunk;
        }
        for (int s = 0; s < nsteps; s++) {
            auto &l = lg[sidx[s]];
            double mx = -1e300; for (float x : l) mx = std::max(mx, (double)x);
            double sum = 0; for (float x : l) sum += std::exp((double)x - mx);
            double lse = mx + std::log(sum);
            fprintf(out, "%s %d", name.c_str(), s);
            for (int k = 0; k < 5; k++) fprintf(out, " %.9f", (double)l[top[s * 5 + k]] - lse);
            fprintf(out, "\n");
        }
        llama_batch_free(b);
        llama_free(ctx);
    }
    fclose(out);
    llama_model_free(model);
    return 0;
}
