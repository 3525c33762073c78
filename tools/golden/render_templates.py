"""Renders chat conversations with HF transformers, from a GGUF's chat template (run by
make.py in its venv).

usage: render_templates.py GGUF_PY_DIR MODEL.gguf IN.json OUT.json
IN.json: [{"name", "messages", "tools"?, "add_generation_prompt"}]; OUT.json:
{"transformers": version, "cases": IN's cases, each with "rendered"}. The rendering is
transformers' render_jinja_template, which apply_chat_template calls, with the GGUF's
tokenizer.chat_template and its BOS/EOS token strings as bos_token/eos_token.
"""
import json
import sys

sys.path.insert(0, sys.argv[1])
import gguf  # noqa: E402  (llama.cpp's gguf-py, from the path above)
import transformers  # noqa: E402
from transformers.utils.chat_template_utils import (  # noqa: E402
    _normalize_chat_messages,
    render_jinja_template,
)

reader = gguf.GGUFReader(sys.argv[2])
field = lambda key: reader.fields[key].contents()  # noqa: E731
template = field("tokenizer.chat_template")
token = lambda key: reader.fields["tokenizer.ggml.tokens"].contents(int(field(key)))  # noqa: E731
bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
cases = json.load(open(sys.argv[3]))
for case in cases:
    rendered, _ = render_jinja_template(
        conversations=[_normalize_chat_messages(case["messages"])],
        tools=case.get("tools"),
        chat_template=template,
        add_generation_prompt=case["add_generation_prompt"],
        bos_token=bos,
        eos_token=eos,
    )
    case["rendered"] = rendered[0]
json.dump({"transformers": transformers.__version__, "cases": cases}, open(sys.argv[4], "w"))
