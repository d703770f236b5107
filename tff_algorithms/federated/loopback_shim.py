"""Builds the preload library that keeps local `worker_binary` on the loopback interface.

worker_binary (TFF 0.87) has a `--port` flag but none for the listen address: it
binds "[::]:port", every interface, with insecure gRPC. Preloaded into it
(`LD_PRELOAD`), this library rewrites a bind to the wildcard address into a bind to
IPv4 loopback (127.0.0.1, or ::ffff:127.0.0.1 on gRPC's dual-stack IPv6 socket,
which then takes IPv4 loopback connections only), and passes every other bind
through. worker_binary links glibc's `bind` dynamically, so the preload takes effect.

The library is compiled from the source below with the system C compiler (`$CC`,
else `cc`) on first use and cached, by source hash, in $XDG_CACHE_HOME/dp-fedemb (default
~/.cache/dp-fedemb), a directory only this user may write: the library is loaded
into the process that runs private computations.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile

_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
  bind_fn real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
  if (addr != NULL && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
    struct sockaddr_in in4;
    memcpy(&in4, addr, sizeof in4);
    if (in4.sin_addr.s_addr == htonl(INADDR_ANY)) {
      in4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      return real_bind(fd, (const struct sockaddr *)&in4, sizeof in4);
    }
  } else if (addr != NULL && addr->sa_family == AF_INET6 &&
             len >= sizeof(struct sockaddr_in6)) {
    struct sockaddr_in6 in6;
    memcpy(&in6, addr, sizeof in6);
    if (IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr)) {
      /* ::ffff:127.0.0.1, the IPv4 loopback address that clients dial. */
      memset(&in6.sin6_addr, 0, sizeof in6.sin6_addr);
      in6.sin6_addr.s6_addr[10] = 0xff;
      in6.sin6_addr.s6_addr[11] = 0xff;
      in6.sin6_addr.s6_addr[12] = 127;
      in6.sin6_addr.s6_addr[15] = 1;
      return real_bind(fd, (const struct sockaddr *)&in6, sizeof in6);
    }
  }
  return real_bind(fd, addr, len);
}
"""


class ShimBuildError(RuntimeError):
    """The preload library could not be compiled (no C compiler, or it failed)."""


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dp-fedemb")


def library_path() -> str:
    """The compiled library's path, building it first when the cache lacks it."""
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    directory = _cache_dir()
    path = os.path.join(directory, f"loopback_bind-{digest}.so")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    # Whoever can replace the library runs code in the worker: refuse a cache that
    # another user owns or can write.
    info = os.stat(directory)
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise ShimBuildError(
            f"{directory} must be owned by this user and writable by nobody else "
            "(it caches a library loaded into the TFF worker)"
        )
    if os.path.isfile(path):
        return path
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise ShimBuildError(
            f"local TFF workers need a C compiler ({compiler!r} not found; set CC) to "
            "build the library that binds them to loopback; or use remote workers"
        )
    with tempfile.TemporaryDirectory(dir=directory) as work:
        source = os.path.join(work, "loopback_bind.c")
        with open(source, "w") as f:
            f.write(_SOURCE)
        built = os.path.join(work, "loopback_bind.so")
        compiled = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-o", built, source, "-ldl"],
            capture_output=True,
            text=True,
        )
        if compiled.returncode != 0:
            raise ShimBuildError(f"{compiler} failed to build {source}:\n{compiled.stderr}")
        os.replace(built, path)  # atomic: concurrent builders each install a whole file
    return path
