import random

import pytest
from transformers import AutoTokenizer

from rlcu.data.prompts import decode_completions, encode_prompts
from rlcu.data.tokenizers import word_tokenizer


def _completions(tok, n=12, seed=0):
    """Random ids over the whole vocabulary (byte pieces that split characters, special tokens, empty rows)."""
    rng = random.Random(seed)
    rows = [[rng.randrange(len(tok)) for _ in range(rng.randrange(0, 40))] for _ in range(n)]
    text = "Réponse: 42 🙂\n\n```py\nprint('ok')\n```  done ,  spaced ."
    rows.append(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    return rows + [[]]


@pytest.mark.parametrize("which", ["smollm2", "words"])
def test_decode_completions_matches_batch_decode(which, smollm2_folder):
    tok = AutoTokenizer.from_pretrained(smollm2_folder) if which == "smollm2" else word_tokenizer(500)
    ids = _completions(tok)
    assert decode_completions(tok, ids) == tok.batch_decode(ids, skip_special_tokens=True)


def test_fast_path_skips_the_python_loop_and_clean_up_falls_back(smollm2_folder, monkeypatch):
    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    ids = _completions(tok)
    expected = tok.batch_decode(ids, skip_special_tokens=True)
    monkeypatch.setattr(type(tok), "batch_decode", lambda *a, **k: pytest.fail("the fast path was not taken"))
    assert decode_completions(tok, ids) == expected
    monkeypatch.undo()

    words = _word_level(["hello", ",", "world", "do", "n't", "."])
    words.clean_up_tokenization_spaces = True  # transformers' clean-up joins " ," and " n't" to the word before
    ids = [[0, 1, 2, 5], [3, 4, 0]]
    want = ["hello, world.", "don't hello"]
    assert decode_completions(words, ids) == words.batch_decode(ids, skip_special_tokens=True) == want


def test_encode_prompts_equals_the_tokenizer_one_prompt_at_a_time(smollm2_folder, monkeypatch):
    """Chat and text prompts, tokenised in one call to the fast backend, as transformers tokenises each; a
    backend with truncation of its own (set in some tokenizer.json files) goes through transformers, which
    lifts it, so a long prompt is not cut where the per-prompt path would not cut it."""
    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    prompts = ["Réponse: 42 🙂 <|im_end|> done", [{"role": "user", "content": "What is 2 + 2?"}],
               [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x" * 300}]]
    texts = [p if isinstance(p, str) else tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
             for p in prompts]
    want = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert encode_prompts(tok, prompts) == want and len(want[2]) > 40
    tok.backend_tokenizer.enable_truncation(max_length=8)
    assert encode_prompts(tok, prompts) == want
    monkeypatch.setattr(type(tok), "__call__", lambda *a, **k: pytest.fail("the backend was not used"))
    tok.backend_tokenizer.no_truncation()
    assert encode_prompts(tok, prompts) == want


def _word_level(words):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words + ["<unk>"])}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")


def _with_bos(tok):
    """A tokenizer whose special tokens are a BOS put before every text (as Gemma's and Llama's are)."""
    from tokenizers import processors

    tok.add_special_tokens({"bos_token": "t0"})
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="t0 $A", special_tokens=[("t0", 0)])
    return tok


@pytest.mark.parametrize("fast", [True, False])
def test_text_prompts_get_the_tokenizers_bos_and_chat_prompts_only_their_template(fast, monkeypatch):
    """TRL 1.16's GRPOTrainer tokenises a text prompt with `processing_class(text=prompts)` (special tokens
    added: a base model gets its BOS) and a chat prompt through `apply_chat_template` (nothing added)."""
    tok = _with_bos(word_tokenizer(50))
    tok.chat_template = "{% for m in messages %}t0 {{ m['content'] }} {% endfor %}t9"
    if not fast:
        monkeypatch.setattr(type(tok), "backend_tokenizer", property(lambda self: None))
    prompts = ["t3 t4", [{"role": "user", "content": "t5"}], "t6"]
    want = [tok(text=prompts[0])["input_ids"], tok.apply_chat_template(prompts[1], add_generation_prompt=True,
                                                                        tokenize=True, return_dict=True)["input_ids"],
            tok(text=prompts[2])["input_ids"]]
    assert want == [[0, 3, 4], [0, 5, 9], [0, 6]]
    assert encode_prompts(tok, prompts) == want
