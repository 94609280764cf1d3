"""The Triton release check: a compiler too old for the kernels is named, not crashed into."""

from __future__ import annotations

import pytest
import torch

from deltalab.ops._triton import (
    HAS_TRITON,
    INTERPRET,
    TRITON_VERSION,
    compiler_too_old_reason,
    triton_unavailable_reason,
)


@pytest.mark.parametrize("version", ["3.2.0", "3.3.0", "3.3.1", "3.3.0+git1a2b3c4"])
def test_a_release_older_than_3_4_is_refused_with_its_version_and_the_oldest_that_compiles(
    version,
):
    reason = compiler_too_old_reason(version)
    assert reason is not None and version in reason and "3.4 or later" in reason


@pytest.mark.parametrize("version", ["3.4.0", "3.6.0", "3.9.0", "3.10.1", "4.0.0", None, "dev"])
def test_releases_from_3_4_on_and_unreadable_versions_are_not_refused(version):
    assert compiler_too_old_reason(version) is None


@pytest.mark.skipif(INTERPRET, reason="the compiled path's check: run without the interpreter")
@pytest.mark.parametrize("version", ["3.3.1", "3.3.1+gitc8757738"])
def test_on_cuda_a_release_older_than_3_4_is_the_reason_triton_cannot_run(version):
    # A CUDA device object needs no GPU: the check reads only its type.
    reason = triton_unavailable_reason(torch.device("cuda"), triton_version=version)
    if not HAS_TRITON:
        assert reason == "Triton is not installed (pip install triton)"
        return
    assert reason is not None and version in reason
    assert triton_unavailable_reason(torch.device("cuda"), triton_version="3.4.0") is None


@pytest.mark.skipif(TRITON_VERSION is None, reason="no Triton distribution's metadata here")
def test_the_installed_release_is_read_from_its_package_metadata():
    import triton

    # A build from source adds a "+git<sha>" local version to the metadata only.
    assert TRITON_VERSION.split("+")[0] == triton.__version__.split("+")[0]
