// Why: the library uses only MPI's C API, and Open MPI's / MPICH's deprecated
// C++ bindings add nothing but warnings; every zero header that needs mpi.h
// includes it through here so the opt-out is made in one place.
#pragma once

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include "zero/compiler.hpp"

#include <mpi.h>
