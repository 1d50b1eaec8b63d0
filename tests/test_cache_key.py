"""PyTorch's compile caches never serve one version of fcoll's ops to another
(``fcoll.ops.cache_key``): the first fcoll version registered in a cache directory keeps the
key tag as it is; any other tags its keys, after the user's own tag. Each case imports fcoll in a
fresh interpreter with its own ``TORCHINDUCTOR_CACHE_DIR``."""

from __future__ import annotations

import os
import subprocess
import sys

from fcoll.ops import cache_key

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tag_after_import(cache_dir, **env) -> str:
    e = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir),
             PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.pop("TORCH_COMPILE_CACHE_KEY_TAG", None)
    e.update(env)
    out = subprocess.run([sys.executable, "-c", "import fcoll, torch.compiler.config as c; "
                          "print(repr(c.cache_key_tag))"], capture_output=True, text=True,
                         timeout=120, env=e, cwd=_ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307  a repr of a str


def test_the_only_version_in_a_cache_directory_leaves_the_key_alone(tmp_path):
    assert _tag_after_import(tmp_path) == ""
    assert _tag_after_import(tmp_path) == ""   # registered once, still the only one
    assert (tmp_path / cache_key.REGISTRY_NAME).read_text().split() == [
        cache_key.source_digest()]


def test_another_version_in_the_directory_tags_this_ones_keys(tmp_path):
    (tmp_path / cache_key.REGISTRY_NAME).write_text("0123456789abcdef\n")
    own = f"fcoll-{cache_key.source_digest()}"
    assert _tag_after_import(tmp_path) == own
    assert _tag_after_import(tmp_path, TORCH_COMPILE_CACHE_KEY_TAG="mine") == f"mine+{own}"
    assert (tmp_path / cache_key.REGISTRY_NAME).read_text().split() == [
        "0123456789abcdef", cache_key.source_digest()]


def test_a_version_registered_after_another_tags_even_if_it_came_first(tmp_path):
    """The first version keeps untagged keys only while it is the only one: once another
    registered, its next process tags too (untagged entries are never read by two versions)."""
    assert cache_key.register(tmp_path, "a" * 16) is True
    assert cache_key.register(tmp_path, "b" * 16) is False
    assert cache_key.register(tmp_path, "a" * 16) is False


def test_caches_off_changes_nothing(tmp_path):
    (tmp_path / "off").mkdir()
    (tmp_path / "off" / cache_key.REGISTRY_NAME).write_text("0123456789abcdef\n")
    assert _tag_after_import(tmp_path / "off", TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                             TORCHINDUCTOR_AUTOGRAD_CACHE="0") == ""
    assert (tmp_path / "off" / cache_key.REGISTRY_NAME).read_text() == "0123456789abcdef\n"


def test_digest_changes_with_any_source_edit(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    d0 = cache_key.source_digest(pkg)
    assert d0 == cache_key.source_digest(pkg) and len(d0) == 16
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    assert cache_key.source_digest(pkg) != d0
    int(d0, 16)  # hex digits
