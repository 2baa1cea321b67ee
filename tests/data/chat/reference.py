"""Chat-template references for tests/chat_data.rs, computed by Hugging Face transformers.

Usage (from the repository root, in a virtualenv with transformers 4.57.1 and its
tokenizers; no torch needed):
    python tests/data/chat/reference.py

Writes, under tests/data/chat/:
- tokenizer.json: a small byte-level BPE trained here, with the special tokens of the
  template families below as added tokens (so each is one id, as in the real models);
- <family>/tokenizer_config.json: the family's chat template as its model publishes it
  (Llama 3 Instruct, Qwen 2.5 Instruct, Mistral Instruct v0.1, Gemma Instruct), with its
  bos and eos tokens; <family>-marked/ the same template with `{% generation %}` blocks
  around each assistant turn's text and end token, as TRL's training templates mark them;
- reference.json: per family and conversation, the rendered text, the token ids and
  transformers' `assistant_masks` (`return_assistant_tokens_mask=True` on the marked
  template), TRL's completion mask for a prompt/completion split of the conversation,
  and the error text for conversations a template refuses.
"""
import json
import os
import shutil

from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_MARKED = (
    "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
QWEN25_MARKED = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {{- message.content + '<|im_end|>\\n' }}
        {%- endgeneration %}
    {%- elif (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
MISTRAL_MARKED = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token}}{% endgeneration %}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
GEMMA_MARKED = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'assistant') %}{{ '<start_of_turn>model\n' }}{% generation %}"
    "{{ message['content'] | trim + '<end_of_turn>\n' }}{% endgeneration %}"
    "{% else %}{{ '<start_of_turn>' + message['role'] + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

FAMILIES = {
    "llama3": (LLAMA3, LLAMA3_MARKED, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5": (QWEN25, QWEN25_MARKED, None, "<|im_end|>"),
    "mistral": (MISTRAL, MISTRAL_MARKED, "<s>", "</s>"),
    "gemma": (GEMMA, GEMMA_MARKED, "<bos>", "<eos>"),
}
SPECIAL = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<bos>", "<eos>", "<pad>",
    "<start_of_turn>", "<end_of_turn>", "[INST]", "[/INST]",
]

CONVERSATIONS = [
    [
        {"role": "user", "content": "What is 12 plus 30?"},
        {"role": "assistant", "content": "12 plus 30 is 42."},
    ],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "  Capital of France?  "},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": " Rome \n"},
    ],
    [
        {"role": "user", "content": "Übersetze: «café» → English, s'il vous plaît."},
        {"role": "assistant", "content": "coffee ☕"},
        {"role": "user", "content": "Thanks!\n\nBye."},
        {"role": "assistant", "content": "Goodbye."},
    ],
]


def train_tokenizer():
    corpus = [
        "What is the capital of France? Paris is the capital. Rome is the capital of Italy.",
        "You are a helpful assistant. Answer in one word. Thanks, goodbye, coffee, plus, is.",
        "system user assistant model tool The quick brown fox jumps over the lazy dog 0123456789",
        "You are Qwen, created by Alibaba Cloud. Conversation roles must alternate.",
    ] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    path = os.path.join(HERE, "tokenizer.json")
    tok.save(path)
    return path


def family_tokenizer(path, template, bos, eos):
    tok = PreTrainedTokenizerFast(tokenizer_file=path, bos_token=bos, eos_token=eos)
    tok.chat_template = template
    return tok


def write_config(name, template, bos, eos):
    d = os.path.join(HERE, name)
    os.makedirs(d, exist_ok=True)
    config = {"chat_template": template, "bos_token": bos, "eos_token": eos}
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def main():
    path = train_tokenizer()
    out = {}
    for name, (template, marked, bos, eos) in FAMILIES.items():
        write_config(name, template, bos, eos)
        write_config(name + "-marked", marked, bos, eos)
        plain = family_tokenizer(path, template, bos, eos)
        gen = family_tokenizer(path, marked, bos, eos)
        cases = []
        for messages in CONVERSATIONS:
            case = {"messages": messages}
            try:
                case["text"] = plain.apply_chat_template(messages, tokenize=False)
            except Exception as e:  # the template's raise_exception
                case["error"] = str(e)
                cases.append(case)
                continue
            case["ids"] = plain.apply_chat_template(messages, tokenize=True)
            assert case["text"] == gen.apply_chat_template(messages, tokenize=False), name
            marked_out = gen.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            assert marked_out["input_ids"] == case["ids"], name
            case["assistant_masks"] = marked_out["assistant_masks"]
            # TRL's conversational prompt/completion: the last assistant turn is the completion
            prompt, completion = messages[:-1], messages[-1:]
            prompt_ids = plain.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
            full_ids = plain.apply_chat_template(prompt + completion, tokenize=True)
            assert full_ids[: len(prompt_ids)] == prompt_ids, name
            case["completion_mask"] = [0] * len(prompt_ids) + [1] * (len(full_ids) - len(prompt_ids))
            cases.append(case)
        out[name] = cases
    with open(os.path.join(HERE, "reference.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
