"""Tokenizers and `Tokenize`: round trips, pipelines, threads, service specs."""

import pickle

import numpy as np
import pytest

import jaxfeed
from jaxfeed.dataset import Dataset
from jaxfeed.service.protocol import spec

TEXTS = ["def f(x):\n    return x + 1\n", "Ünïcödé prose, with punctuation!", ""]


def test_byte_tokenizer_round_trips_utf8_and_ends_documents():
  tokenizer = jaxfeed.ByteTokenizer()
  for text in TEXTS:
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32 and ids.max(initial=0) < 256
    assert tokenizer.decode(ids) == text
    assert np.array_equal(ids, tokenizer.encode(text.encode()))
  assert tokenizer.decode([104, 105, tokenizer.eos_id]) == "hi"
  assert tokenizer.vocab_size == tokenizer.eos_id + 1


def test_tokenize_maps_text_features_and_bare_records():
  tokenize = jaxfeed.Tokenize(jaxfeed.ByteTokenizer())
  out = tokenize({"text": b"ab", "id": np.int64(3)})
  assert out["tokens"].tolist() == [97, 98, 256] and out["id"] == 3
  assert "text" not in out
  assert jaxfeed.Tokenize(jaxfeed.ByteTokenizer(), append_eos=False)(b"ab")["tokens"].tolist() == [
    97,
    98,
  ]
  with pytest.raises(KeyError, match="no feature 'text'.*'body'"):
    tokenize({"body": b"x"})
  with pytest.raises(TypeError, match="bytes or str.*int"):
    tokenize(5)
  with pytest.raises(TypeError, match="ByteTokenizer or HFTokenizer"):
    jaxfeed.Tokenize(object())


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "bpe.json"
  corpus = [t * 20 for t in TEXTS[:2]] + ["import os\nprint(os.getcwd())\n"] * 10
  return jaxfeed.HFTokenizer.train_bpe(corpus, path, vocab_size=300)


def test_a_bpe_tokenizer_trained_locally_round_trips_and_compresses(bpe):
  text = TEXTS[0] * 3
  ids = bpe.encode(text)
  assert bpe.decode(ids) == text
  assert len(ids) < len(text.encode())  # merges learned from the corpus
  assert bpe.encode(b"x").dtype == np.int32
  assert 256 < bpe.vocab_size <= 300 and 0 <= bpe.eos_id < bpe.vocab_size


def test_hf_tokenizer_errors_name_the_file_and_the_token(tmp_path, bpe):
  with pytest.raises(FileNotFoundError, match="no tokenizer file at .*missing.json"):
    jaxfeed.HFTokenizer(tmp_path / "missing.json")
  with pytest.raises(ValueError, match="no token '<eos>'"):
    jaxfeed.HFTokenizer(bpe.path, eos_token="<eos>")


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_tokenize_gives_the_same_tokens_on_threads_and_resumes(tokenizer, bpe):
  chosen = jaxfeed.ByteTokenizer() if tokenizer == "bytes" else bpe
  texts = [f"line {i}: " + TEXTS[i % 2] * (i % 7) for i in range(200)]

  def build(calls):
    return Dataset.from_tensor_slices(np.array(texts, dtype=object)).map(
      jaxfeed.Tokenize(chosen), num_parallel_calls=calls
    )

  expected = [chosen.encode(t).tolist() + [chosen.eos_id] for t in texts]
  for calls in (None, 4, jaxfeed.AUTOTUNE):
    assert [e["tokens"].tolist() for e in build(calls)] == expected
  with build(4).make_iterator() as iterator:
    for _ in range(37):
      next(iterator)
    state = iterator.get_state()
  with build(4).make_iterator() as restored:
    restored.set_state(state)
    assert [e["tokens"].tolist() for e in restored] == expected[37:]


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_tokenizing_pipelines_travel_to_service_workers(tokenizer, bpe):
  chosen = jaxfeed.ByteTokenizer() if tokenizer == "bytes" else bpe
  ds = Dataset.from_tensor_slices(np.array(TEXTS[:2])).map(
    jaxfeed.Tokenize(chosen, append_eos=False)
  )
  rebuilt = Dataset(spec.from_dataset_def(spec.to_dataset_def(ds.node)))
  assert [e["tokens"].tolist() for e in rebuilt] == [e["tokens"].tolist() for e in ds]
  assert pickle.loads(pickle.dumps(chosen)).encode("abc").tolist() == (
    chosen.encode("abc").tolist()
  )


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_batched_tokenize_equals_per_document_on_threads_and_resumes(tokenizer, bpe):
  chosen = jaxfeed.ByteTokenizer() if tokenizer == "bytes" else bpe
  texts = [f"line {i}: " + TEXTS[i % 2] * (i % 7) for i in range(200)]
  expected = [chosen.encode(t).tolist() + [chosen.eos_id] for t in texts]
  assert [ids.tolist() for ids in chosen.encode_many(texts)] == [e[:-1] for e in expected]

  def build(calls):
    return (
      Dataset.from_source([t.encode() for t in texts])
      .batch(16)
      .map(jaxfeed.Tokenize(chosen, batched=True), num_parallel_calls=calls)
      .unbatch()
    )

  for calls in (None, 3):
    got = list(build(calls))
    assert [e["tokens"].tolist() for e in got] == expected
    assert all(e["tokens"].dtype == np.int32 for e in got)
  with build(3).make_iterator() as iterator:
    for _ in range(37):
      next(iterator)
    state = iterator.get_state()
  with build(3).make_iterator() as restored:
    restored.set_state(state)
    assert [e["tokens"].tolist() for e in restored] == expected[37:]


def test_batched_tokenize_names_what_it_needs(bpe):
  batched = jaxfeed.Tokenize(bpe, batched=True)
  with pytest.raises(TypeError, match=r"batched=True.*1-D array of texts"):
    batched(b"one document")
  with pytest.raises(TypeError, match="batched must be True or False"):
    jaxfeed.Tokenize(bpe, batched="yes")

  class EncodeOnly:
    eos_id = 0

    def encode(self, text):
      return np.zeros(1, np.int32)

  with pytest.raises(TypeError, match="EncodeOnly has no encode_many"):
    jaxfeed.Tokenize(EncodeOnly(), batched=True)
  ds = Dataset.from_source([b"ab", b"c"]).batch(2).map(batched).unbatch()
  rebuilt = Dataset(spec.from_dataset_def(spec.to_dataset_def(ds.node)))
  assert [e["tokens"].tolist() for e in rebuilt] == [e["tokens"].tolist() for e in ds]
