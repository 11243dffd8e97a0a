"""The API reference builds without warnings, and every public name and
Dataset method says what it does."""

import inspect
import warnings

import pdoc

import jaxfeed


def test_every_public_name_and_dataset_method_has_a_docstring():
  missing = [name for name in jaxfeed.__all__
             if not isinstance(getattr(jaxfeed, name), (int, float, str))
             and not inspect.getdoc(getattr(jaxfeed, name))]
  assert not missing, missing
  undocumented = [name for name, member in inspect.getmembers(jaxfeed.Dataset)
                  if not name.startswith("_") and callable(member)
                  and not inspect.getdoc(member)]
  assert not undocumented, undocumented


def test_every_listed_submodule_is_reachable_as_an_attribute():
  import types
  for name in jaxfeed.__all__:
    value = getattr(jaxfeed, name)
    if isinstance(value, types.ModuleType):
      assert inspect.getdoc(value), name
  assert jaxfeed.example.parse_example and jaxfeed.image.decode_jpeg


def test_dataset_docstrings_say_what_users_ask_about():
  assert "drop_remainder" in inspect.getdoc(jaxfeed.Dataset.batch)
  map_doc = inspect.getdoc(jaxfeed.Dataset.map)
  assert '"process"' in map_doc and "unpacked into arguments" in map_doc
  for method in ("shuffle", "unbatch", "padded_batch", "interleave", "repeat",
                 "cache"):
    assert len(inspect.getdoc(getattr(jaxfeed.Dataset, method))) > 80, method


def test_the_api_reference_builds_without_warnings(tmp_path):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pdoc.pdoc("jaxfeed", output_directory=tmp_path)
  messages = [str(w.message) for w in caught
              if "pdoc" in (w.filename or "") or issubclass(w.category, UserWarning)]
  assert not messages, messages[:10]
  page = (tmp_path / "jaxfeed.html").read_text()
  assert 'id="Dataset.batch"' in page and "drop_remainder" in page
