"""Tiny real tokenizers, trained in a blink with the `tokenizers` library, for tests (no hub access exists).

`build_tokenizer(dir, kind)` writes tokenizer.json + tokenizer_config.json (with a chat template) shaped like
the real families: "qwen" (ChatML, no BOS, Qwen3's thinking/tool template) and "llama" (Llama 3: BOS added by
a TemplateProcessing post-processor, header-id template). Both have exactly VOCAB_SIZE tokens, added tokens
included, so a tiny test model can use `vocab_size=VOCAB_SIZE`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

VOCAB_SIZE = 512

# The pre-tokenizer regexes of the real tokenizer.json files, so that splitting behaves like the real thing.
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# (content, special): Qwen3 marks <think> and the tool tags as added but *not* special, so decode keeps them.
QWEN_ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
              ("<think>", False), ("</think>", False), ("<tool_call>", False), ("</tool_call>", False),
              ("<tool_response>", False), ("</tool_response>", False)]
LLAMA_ADDED = [(t, True) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                                    "<|finetune_right_pad_id|>", "<|start_header_id|>", "<|end_header_id|>",
                                    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")]

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's a sunny day, isn't it?",
    "Hello world! How are you today? I'm fine, thanks; we've been busy.",
    "You are a helpful assistant. Answer the user's question briefly and truthfully.",
    "What is the capital of France? The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7",
    "日本語のテキストも少しあります。東京は日本の首都です。",
    "中文文本：你好，世界！今天天气很好。",
    "Emoji time 😀🎉👍🏽 and accents: café, naïve, Zürich, señor.",
    "Привет, мир! Как дела? Ελληνικά κείμενα επίσης.",
    "<think>\nLet me reason step by step.\n</think>\n\nThe answer is 4.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
]

QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Llama 3.2-style: the template writes bos_token itself, so callers must tokenize with add_special_tokens=False.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles are supported after the system message, got ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""


def _train(split_regex: str, added: list[tuple[str, bool]], nfc: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # Real checkpoints put added tokens after the trained vocabulary, so train to leave exactly room for them.
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(added), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.add_tokens([AddedToken(c, special=s, normalized=False) for c, s in added])
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE, "corpus too small to fill the vocabulary"
    return tok


def _added_tokens_decoder(tok: Tokenizer) -> dict[str, dict]:
    return {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special}
            for i, t in sorted(tok.get_added_tokens_decoder().items())}


def build_tokenizer(tmp_dir, kind: str = "qwen") -> None:
    """Write tokenizer.json and tokenizer_config.json (with chat_template) of a `kind` tokenizer into tmp_dir."""
    out = Path(tmp_dir)
    out.mkdir(parents=True, exist_ok=True)
    if kind == "qwen":
        tok = _train(QWEN_SPLIT, QWEN_ADDED, nfc=True)
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        config = {"add_bos_token": False, "add_prefix_space": False, "bos_token": None,
                  "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
                  "errors": "replace", "model_max_length": 4096, "split_special_tokens": False,
                  "clean_up_tokenization_spaces": False, "tokenizer_class": "Qwen2Tokenizer",
                  "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                  "chat_template": QWEN3_TEMPLATE}
    elif kind == "llama":
        tok = _train(LLAMA3_SPLIT, LLAMA_ADDED, nfc=False)
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                          special_tokens=[(bos, tok.token_to_id(bos))]),
        ])
        # Llama 3 really ships clean_up_tokenization_spaces=true; transformers ignores it for BPE models.
        config = {"bos_token": bos, "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True,
                  "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
                  "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": LLAMA3_TEMPLATE}
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'qwen' or 'llama'")
    config["added_tokens_decoder"] = _added_tokens_decoder(tok)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


def copy_tokenizer_dir(src, dst, config=None, files=None):
    """A copy of tokenizer directory `src` at `dst`, with `config` merged into its tokenizer_config.json and
    `files` ({name: str or bytes}) written beside it: one bad field or file per test."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(config or {})
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name, data in (files or {}).items():
        (dst / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return dst
