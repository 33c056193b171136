#!/usr/bin/env bash
# scripts/zero.sh's install logic on a pretend bare machine: dpkg-query, apt-get,
# id and sudo are stubs that read what is "installed" from a file and log each
# call, so every branch (root, sudo, no sudo, refusal, failure, no apt) runs
# here without touching this machine's packages.
set -uo pipefail
# The cases set what they test; a caller's setting (CI runs the tests under
# scripts/zero.sh with ZERO_NO_INSTALL=1) must not reach them.
unset ZERO_NO_INSTALL
repo=$(cd "$(dirname "$0")/../.." && pwd)
script="$repo/scripts/zero.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

# Only the tools the script needs, so a real sudo or apt-get never shows through.
mkdir -p "$work/tools"
for tool in bash env grep sed dirname printf cat; do
  real=$(command -v "$tool") || { echo "test needs $tool"; exit 1; }
  ln -s "$real" "$work/tools/$tool"
done

make_stubs() { # $1 = folder; $2.. = stubs to leave out
  local dir=$1
  shift
  mkdir -p "$dir"
  cat >"$dir/dpkg-query" <<'STUB'
#!/bin/sh
# dpkg-query -W -f='${Status}' PACKAGE
for last; do :; done
grep -qx "$last" "$STATE/installed" && printf 'install ok installed' && exit 0
exit 1
STUB
  cat >"$dir/apt-get" <<'STUB'
#!/bin/sh
echo "apt-get $* [uid=$UID_AS]" >>"$STATE/log"
[ "$1" = install ] && [ -n "${APT_FAIL:-}" ] && exit 100
exit 0
STUB
  cat >"$dir/id" <<'STUB'
#!/bin/sh
echo "$FAKE_UID"
STUB
  cat >"$dir/sudo" <<'STUB'
#!/bin/sh
echo "sudo $1" >>"$STATE/log"
UID_AS=0 exec "$@"
STUB
  local leave
  for leave in "$@"; do rm -f "$dir/$leave"; done
  chmod +x "$dir"/*
}

# run NAME FAKE_UID "installed packages" [stub to leave out...] -- runs `zero.sh setup`
run() {
  local name=$1 uid=$2 installed=$3
  shift 3
  export STATE="$work/$name"
  mkdir -p "$STATE"
  tr ' ' '\n' <<<"$installed" >"$STATE/installed"
  : >"$STATE/log"
  make_stubs "$STATE/bin" "$@"
  FAKE_UID=$uid UID_AS=$uid PATH="$STATE/bin:$work/tools" bash "$script" setup >"$STATE/out" 2>&1
  echo $? >"$STATE/rc"
}

expect() { # NAME description command...
  local name=$1 what=$2
  shift 2
  if ! (cd "$work/$name" && eval "$*"); then
    echo "FAIL [$name] $what"
    echo "  output: $(cat "$work/$name/out")"
    echo "  apt log: $(cat "$work/$name/log")"
    failures=$((failures + 1))
  fi
}

# The package lists, read from the script itself so the test follows them.
all=$(bash -c "source <(sed -n '/^train_packages=/,/^test_packages=.*)/p' '$script'); echo \${train_packages[*]} \${test_packages[*]}")
[[ $(wc -w <<<"$all") -ge 10 ]] || { echo "FAIL could not read the package lists from zero.sh: '$all'"; exit 1; }
all_but_two=$(tr ' ' '\n' <<<"$all" | grep -vx -e meson -e catch2 | tr '\n' ' ')

run all-present 0 "$all"
expect all-present "exit 0" '[[ $(cat rc) == 0 ]]'
expect all-present "no apt-get call when nothing is missing" '[[ ! -s log ]]'

run root-missing 0 "$all_but_two"
expect root-missing "exit 0" '[[ $(cat rc) == 0 ]]'
expect root-missing "one apt-get update" '[[ $(grep -c "^apt-get update" log) == 1 ]]'
expect root-missing "installs exactly the two missing" 'grep -q "^apt-get install -y -qq --no-install-recommends meson catch2 \[uid=0\]" log'
expect root-missing "names what it installs" 'grep -q "meson catch2" out'

run user-sudo 1000 "$all_but_two"
expect user-sudo "exit 0" '[[ $(cat rc) == 0 ]]'
expect user-sudo "installs through sudo as root" '[[ $(grep -c "^sudo env" log) == 2 ]] && grep -q "^apt-get install.*meson catch2 \[uid=0\]" log'

run user-no-sudo 1000 "$all_but_two" sudo
expect user-no-sudo "fails" '[[ $(cat rc) != 0 ]]'
expect user-no-sudo "says root is needed and names the packages" 'grep -q "needs root" out && grep -q "apt-get install meson catch2" out'
expect user-no-sudo "calls no apt-get" '[[ ! -s log ]]'

export ZERO_NO_INSTALL=1
run refused 0 "$all_but_two"
unset ZERO_NO_INSTALL
expect refused "fails, names the packages, installs nothing" '[[ $(cat rc) != 0 ]] && grep -q "meson catch2" out && [[ ! -s log ]]'

export APT_FAIL=1
run apt-fails 0 "$all_but_two"
unset APT_FAIL
expect apt-fails "a failed install is an error naming the packages" '[[ $(cat rc) != 0 ]] && grep -q "apt-get install failed for: meson catch2" out'

run no-apt 0 "$all_but_two" apt-get
expect no-apt "without apt-get: an error naming the packages" '[[ $(cat rc) != 0 ]] && grep -q "missing packages: meson catch2" out'

if ((failures)); then
  echo "$failures check(s) failed"
  exit 1
fi
echo "zero.sh install logic: all checks passed"
