"""The memory figures a landing sizes its reads by, as the kernel reports them."""

from __future__ import annotations

import os
import sys

import pytest

from runtime.bundles.sources import pages
from runtime.models.weights import framework

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc/meminfo is Linux's")


def test_meminfo_reads_the_kernels_figures_in_bytes() -> None:
    # sysinfo(2)'s total RAM is what /proc/meminfo prints as MemTotal, in KiB.
    assert pages.meminfo("MemTotal") == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < pages.available_bytes() <= pages.meminfo("MemTotal")


def test_a_figure_the_kernel_does_not_print_is_zero() -> None:
    assert pages.meminfo("NoSuchFigure") == 0
    assert pages.meminfo("MemTotal:") == 0  # the name, not a line prefix


def test_the_host_limit_is_at_most_the_machines_memory() -> None:
    limit = framework.host_memory_limit()
    assert 0 < limit <= pages.meminfo("MemTotal")
