#!/bin/sh
echo "bazel coverage is not available in this offline workspace (its coverage tools are a download)" >&2
exit 1
