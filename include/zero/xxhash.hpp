// Why: checkpoints (checkpoint/manifest.hpp) and the disk tier
// (offload/disk_swap.hpp) both checksum with xxHash, and a header-only
// library cannot ask its users for -lxxhash: xxHash is compiled into the
// including program. XXH_INLINE_ALL gives its symbols private names, so a
// program that also links libxxhash sees no clash; the macro is set only for
// this include, unless the program set it itself.
#pragma once

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#define ZERO_DEFINED_XXH_INLINE_ALL
#endif
#include <xxhash.h>
#ifdef ZERO_DEFINED_XXH_INLINE_ALL
#undef XXH_INLINE_ALL
#undef ZERO_DEFINED_XXH_INLINE_ALL
#endif
