"""Tokenizers for text pipelines, and the `Tokenize` map function.

Two tokenizers with one interface (`encode(text) -> int32 array`,
`encode_many(texts) -> list of int32 arrays`, `decode(ids) -> str`,
`vocab_size`, `eos_id`):

- `ByteTokenizer`: the UTF-8 bytes of the text (ids 0-255) plus an
  end-of-document id 256. No dependency, no file, and fast (one
  `np.frombuffer` per document).
- `HFTokenizer`: a Hugging Face `tokenizers` tokenizer loaded from a local
  `tokenizer.json` (the optional `text` extra: `pip install jaxfeed[text]`).
  `HFTokenizer.train_bpe` trains a byte-level BPE tokenizer on local texts and
  writes that file; nothing is ever downloaded. Encoding runs in Rust.

In a pipeline, `map(Tokenize(tokenizer), num_parallel_calls=...)` turns
`{"text": bytes or str}` elements into `{"tokens": int32 array}` (other
features pass through). With a Hugging Face tokenizer, tokenize batches
instead: `batch(64).map(Tokenize(tokenizer, batched=True),
num_parallel_calls=...).unbatch()`. `Tokenizer.encode` holds the GIL for the
whole Rust call, so per-document maps do not scale on threads;
`encode_batch_fast` releases it (see docs/llm_text.md for measurements).
Both tokenizers and `Tokenize` list their `spec_params()`, so pipelines that
use them travel to service workers (the HF tokenizer file must exist at the
same path on the workers).
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import numpy as np

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenize"]


def _as_bytes(text: Any) -> bytes:
  if isinstance(text, bytes):
    return text
  if isinstance(text, str):
    return text.encode("utf-8")
  if isinstance(text, np.ndarray) and text.ndim == 0:
    return _as_bytes(text.item())
  if isinstance(text, (np.bytes_, np.str_)):
    return _as_bytes(text.item())
  raise TypeError(f"Tokenize: text must be bytes or str, got {type(text).__name__}: {text!r:.80}.")


class ByteTokenizer:
  """UTF-8 bytes as token ids 0-255; id 256 ends a document."""

  vocab_size = 257
  eos_id = 256

  def encode(self, text: bytes | str) -> np.ndarray:
    """The token ids of `text` (int32, one per UTF-8 byte)."""
    return np.frombuffer(_as_bytes(text), np.uint8).astype(np.int32)

  def encode_many(self, texts: Iterable[bytes | str]) -> list[np.ndarray]:
    """`[encode(t) for t in texts]`."""
    return [self.encode(t) for t in texts]

  def decode(self, ids: Iterable[int]) -> str:
    """The text of `ids`; the end-of-document id and invalid UTF-8 are dropped
    or replaced."""
    values = np.asarray(ids, np.int64)
    return bytes(values[(values >= 0) & (values < 256)].astype(np.uint8)).decode(
      "utf-8", errors="replace"
    )

  def spec_params(self) -> dict:
    return {}

  def __repr__(self) -> str:
    return "ByteTokenizer()"

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, ByteTokenizer)

  def __hash__(self) -> int:
    return hash(ByteTokenizer)


class HFTokenizer:
  """A Hugging Face `tokenizers` tokenizer read from a local tokenizer.json.

  Args:
    path: the tokenizer.json file.
    eos_token: the token that ends a document; it must be in the vocabulary.
  """

  def __init__(self, path: str | os.PathLike, eos_token: str = "<|endoftext|>"):
    try:
      from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError(
        "HFTokenizer needs the `tokenizers` package: pip install "
        "'jaxfeed[text]' (or use jaxfeed.text.ByteTokenizer, which needs "
        "nothing)."
      ) from e
    self.path = os.fspath(path)
    if not os.path.isfile(self.path):
      raise FileNotFoundError(
        f"HFTokenizer: no tokenizer file at {self.path!r}; train one with "
        "HFTokenizer.train_bpe(texts, path) or copy a tokenizer.json there."
      )
    self._tokenizer = Tokenizer.from_file(self.path)
    self.eos_token = eos_token
    eos_id = self._tokenizer.token_to_id(eos_token)
    if eos_id is None:
      raise ValueError(
        f"HFTokenizer: {self.path!r} has no token {eos_token!r} "
        "to end documents with; pass eos_token=... of its vocabulary."
      )
    self.eos_id = int(eos_id)
    self.vocab_size = int(self._tokenizer.get_vocab_size())

  @classmethod
  def train_bpe(
    cls,
    texts: Iterable[str],
    path: str | os.PathLike,
    vocab_size: int = 4096,
    eos_token: str = "<|endoftext|>",
  ) -> "HFTokenizer":
    """Trains a byte-level BPE tokenizer on `texts`, writes it to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top,g-multiple-import

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=[eos_token],
      show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    tokenizer.save(tmp)
    os.replace(tmp, path)
    return cls(path, eos_token)

  def encode(self, text: bytes | str) -> np.ndarray:
    """The token ids of `text` (int32)."""
    if not isinstance(text, str):
      text = _as_bytes(text).decode("utf-8", errors="replace")
    return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  def encode_many(self, texts: Iterable[bytes | str]) -> list[np.ndarray]:
    """`[encode(t) for t in texts]` in one Rust call that releases the GIL, so
    several threads encode at once. The call also spreads over the
    tokenizers library's own threads unless TOKENIZERS_PARALLELISM=false."""
    strings = [
      t if isinstance(t, str) else _as_bytes(t).decode("utf-8", errors="replace") for t in texts
    ]
    encodings = self._tokenizer.encode_batch_fast(strings, add_special_tokens=False)
    return [np.asarray(e.ids, np.int32) for e in encodings]

  def decode(self, ids: Iterable[int]) -> str:
    return self._tokenizer.decode([int(i) for i in ids])

  def spec_params(self) -> dict:
    return {"path": self.path, "eos_token": self.eos_token}

  def __repr__(self) -> str:
    return f"HFTokenizer({self.path!r}, eos_token={self.eos_token!r})"

  def __getstate__(self) -> dict:
    return self.spec_params()

  def __setstate__(self, state: dict) -> None:
    self.__init__(**state)  # pylint: disable=unnecessary-dunder-call


class Tokenize:
  """A map function: `element[feature]` (text) -> `element[output]` (ids).

  Args:
    tokenizer: a `ByteTokenizer` or `HFTokenizer`.
    feature: the key of the text in dict elements (bytes or str); elements
      that are the text itself are tokenized as `{output: ids}`.
    output: the key of the token ids in the result.
    append_eos: end every document with the tokenizer's `eos_id`, so packed
      rows still say where one document ended.
    batched: the input is a batch (`batch(k)` of texts: a 1-D array of
      bytes or str); the output's `output` leaf is then a 1-D object array
      of int32 id arrays, one per text, which `unbatch()` splits again. All
      texts of the batch are encoded in one `encode_many` call.
  """

  def __init__(
    self,
    tokenizer: Any,
    feature: str = "text",
    output: str = "tokens",
    append_eos: bool = True,
    batched: bool = False,
  ):
    if not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "eos_id")):
      raise TypeError(
        "Tokenize: tokenizer must be a jaxfeed.text.ByteTokenizer "
        f"or HFTokenizer, got {type(tokenizer).__name__}."
      )
    if not isinstance(batched, (bool, np.bool_)):
      raise TypeError(f"Tokenize: batched must be True or False, got {batched!r}.")
    if batched and not hasattr(tokenizer, "encode_many"):
      raise TypeError(
        f"Tokenize(batched=True): {type(tokenizer).__name__} has "
        "no encode_many(texts) to encode a batch with."
      )
    self.tokenizer = tokenizer
    self.feature = feature
    self.output = output
    self.append_eos = bool(append_eos)
    self.batched = bool(batched)

  def __call__(self, element: Any) -> dict:
    if isinstance(element, dict):
      if self.feature not in element:
        raise KeyError(
          f"Tokenize: the element has no feature {self.feature!r} (it has {sorted(element)})."
        )
      result = {k: v for k, v in element.items() if k != self.feature}
      text = element[self.feature]
    else:
      result, text = {}, element
    if self.batched:
      result[self.output] = self._encode_batch(text)
    else:
      result[self.output] = self._with_eos(self.tokenizer.encode(text))
    return result

  def _with_eos(self, ids: np.ndarray) -> np.ndarray:
    if self.append_eos:
      ids = np.append(ids, np.int32(self.tokenizer.eos_id))
    return ids

  def _encode_batch(self, texts: Any) -> np.ndarray:
    if np.ndim(texts) != 1 or isinstance(texts, (str, bytes)):
      raise TypeError(
        f"Tokenize(batched=True): the text must be a batch (a 1-D array of "
        f"texts, e.g. after .batch(k)), got {type(texts).__name__} of shape "
        f"{np.shape(texts)}."
      )
    out = np.empty(len(texts), object)
    for i, ids in enumerate(self.tokenizer.encode_many(list(texts))):
      out[i] = self._with_eos(ids)
    return out

  def __repr__(self) -> str:
    return (
      f"Tokenize({self.tokenizer!r}, feature={self.feature!r}, "
      f"output={self.output!r}, append_eos={self.append_eos}, "
      f"batched={self.batched})"
    )

  def spec_params(self) -> dict:
    return {
      "tokenizer": self.tokenizer,
      "feature": self.feature,
      "output": self.output,
      "append_eos": self.append_eos,
      "batched": self.batched,
    }
