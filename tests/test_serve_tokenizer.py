"""The embedded model's tokenizer as standard files: mlx-lm loads them, ids are UTF-8 bytes, and the
chat template renders plain chats, tools and tool calls."""

from __future__ import annotations

import pathlib
import random

import pytest

from asyncside.models.tokenizer import ByteTokenizer, load_tokenizer, save_byte_level_tokenizer
from asyncside.serving.protocol import ChatMessage, chat_prompt_ids, simple_chat_template

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> object:
    d = tmp_path_factory.mktemp("tok")
    save_byte_level_tokenizer(d)
    return load_tokenizer(d, {"eos_token_id": ByteTokenizer.EOS})


def test_ids_are_utf8_bytes_and_round_trip(tok: object) -> None:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    assert isinstance(tok, TokenizerWrapper)
    rng = random.Random(7)
    alphabet = "aZ09 \n\t.,;<|>{}\"'é€😀\u0301"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        ids = tok.encode(text)
        assert ids == ByteTokenizer().encode(text)
        assert tok.decode(ids) == text
    assert tok.eos_token_ids == {ByteTokenizer.EOS}
    assert tok.encode("<|endoftext|>") == [ByteTokenizer.EOS]  # the special token is one id


def test_chat_template_matches_the_simple_format_and_renders_tools(tok: object) -> None:
    msgs = [ChatMessage("system", "be brief"), ChatMessage("user", "hi")]
    assert chat_prompt_ids(tok, msgs) == ByteTokenizer().encode(simple_chat_template(msgs))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    history = [*msgs, ChatMessage("assistant", None, ({"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}},)), ChatMessage("tool", "sunny", tool_call_id="c1")]
    text = tok.decode(chat_prompt_ids(tok, history, tools=tools))
    assert '"name": "get_weather"' in text.split("</tools>")[0]  # offered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<|tool|>\nsunny\n' in text
    assert text.endswith("<|assistant|>\n")
    # mlx-lm recognises the format from the template and parses what the model would write.
    assert (tok.tool_call_start, tok.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert tok.tool_parser('\n{"name": "f", "arguments": {"x": 1}}\n', tools) == {"name": "f", "arguments": {"x": 1}}


def test_mlx_lm_loads_the_embedded_model_directory() -> None:
    """What `mlx_lm.server --model <embedded model dir>` needs: the model and its tokenizer load."""
    from mlx_lm.utils import load

    from asyncside.models.embedded import ensure_embedded_default

    model_dir, store_dir = ensure_embedded_default()
    model, tokenizer = load(str(model_dir))
    assert tokenizer.encode("Hi") == [72, 105] and tokenizer.chat_template
    for d in (model_dir, store_dir):
        assert (pathlib.Path(d) / "tokenizer.json").is_file() and (pathlib.Path(d) / "tokenizer_config.json").is_file()
