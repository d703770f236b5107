"""The rule names that Bazel 4's @bazel_tools packages load from @rules_cc.

Bazel 4.2 still has these rules built in; this file only makes them loadable
under the names its tool packages expect, so no rules_cc download is needed.
"""

cc_binary = native.cc_binary
cc_library = native.cc_library
cc_proto_library = native.cc_proto_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
objc_library = native.objc_library
