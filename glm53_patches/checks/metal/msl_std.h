// The C++ library the emulation runtime of msl.h uses (a header of its own, so builds can precompile it).
#pragma once
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <csetjmp>
#include <memory>
#include <ucontext.h>
#include <vector>
