"""The Triton release check: a compiler too old for the kernels is named, not crashed into."""

from __future__ import annotations

import pytest

from deltalab.ops._triton import HAS_TRITON, TRITON_VERSION, compiler_too_old_reason


@pytest.mark.parametrize("version", ["3.2.0", "3.3.0", "3.3.1", "3.3.0+git1a2b3c4"])
def test_a_release_older_than_3_4_is_refused_with_its_version_and_the_oldest_that_compiles(
    version,
):
    reason = compiler_too_old_reason(version)
    assert reason is not None and version in reason and "3.4 or later" in reason


@pytest.mark.parametrize("version", ["3.4.0", "3.6.0", "3.9.0", "3.10.1", "4.0.0", None, "dev"])
def test_releases_from_3_4_on_and_unreadable_versions_are_not_refused(version):
    assert compiler_too_old_reason(version) is None


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_the_installed_release_is_read_without_importing_triton_and_matches_it():
    import triton

    assert TRITON_VERSION == triton.__version__
