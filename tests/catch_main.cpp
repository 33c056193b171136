// The Catch2 runner shared by every host test executable (compiled once).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
