# Shared by bench/run, bench/profile and bench/stages (sourced, not run): how a
# promptgate variant is configured, and waiting for a process to say where it listens.

# promptgate with no rules, no capture and no cache analysis (all on by default).
pass_through_flags=(--no-capture --no-cache-analysis --admin off)

# read_variant NAME RUN_DIR: reads bench/variants/NAME.flags (`{run}` becomes
# RUN_DIR, `{pg}` becomes $pg_url, the database bench/stages made for the run) into variant_flags (the serve flags), variant_requires ("path P" or
# "verb V" for each `@requires-path P` / `@requires-verb V` line) and
# variant_viewers (`@viewers N`: live-feed clients bench/stages keeps connected) and
# variant_service (`@service CMD…`: a program bench/run starts before the variant,
# such as a hook's HTTP policy service; its CPU is not promptgate's) and
# variant_bin (`@bin PATH`: another promptgate build to run, for an A/B of two
# commits in one interleaved bench/stages run; empty: this tree's).
# "pass-through" is built in. Returns 1 when the file does not exist.
read_variant() {
  local name=$1 run=$2 file=bench/variants/$1.flags line words
  variant_flags=()
  variant_requires=()
  variant_viewers=0
  variant_service=()
  variant_bin=
  if [ "$name" = pass-through ]; then
    variant_flags=("${pass_through_flags[@]}")
    return 0
  fi
  [ -f "$file" ] || return 1
  while IFS= read -r line || [ -n "$line" ]; do
    line=${line%%#*}
    line=${line//\{run\}/$run}
    read -ra words <<<"${line//\{pg\}/${pg_url:-}}"
    [ ${#words[@]} = 0 ] && continue
    case ${words[0]} in
      @requires-path) variant_requires+=("path ${words[1]}") ;;
      @requires-verb) variant_requires+=("verb ${words[1]}") ;;
      @viewers) variant_viewers=${words[1]} ;;
      @service) variant_service=("${words[@]:1}") ;;
      @bin) variant_bin=${words[1]} ;;
      *) variant_flags+=("${words[@]}") ;;
    esac
  done <"$file"
}

# wait_for_line FILE REGEX PID [TRIES]: prints the first match of REGEX in FILE,
# polling every 50 ms while PID lives; returns 1 if PID dies or TRIES run out.
wait_for_line() {
  local file=$1 regex=$2 pid=$3 tries=${4:-100} line
  for _ in $(seq 1 "$tries"); do
    line=$(grep -oE "$regex" "$file" 2>/dev/null | head -1 || true)
    [ -n "$line" ] && { echo "$line"; return 0; }
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}

# wait_for_addr FILE PID: the first 127.0.0.1:PORT the process writes (up to 30 s).
wait_for_addr() { wait_for_line "$1" '127\.0\.0\.1:[0-9]+' "$2" 600; }

# start_postgres: a throwaway PostgreSQL cluster (Debian's postgresql, its default
# settings) in a new temporary directory, on a free loopback port; as root it runs
# as the postgres user. Sets pg_port; stop_postgres stops it and removes it.
start_postgres() {
  local dir
  pg_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
  [ -n "$pg_bin" ] && [ -x "$pg_bin/initdb" ] || { echo "needs Debian's postgresql (bench/setup installs it)" >&2; return 1; }
  dir=$(mktemp -d /tmp/promptgate-bench-pg.XXXXXX)
  pg_as=()
  if [ "$(id -u)" = 0 ]; then chown postgres "$dir"; pg_as=(runuser -u postgres --); fi
  pg_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "${pg_as[@]}" "$pg_bin/initdb" -D "$dir/data" -U promptgate -A trust >"$dir/initdb.log" 2>&1 || { cat "$dir/initdb.log" >&2; return 1; }
  "${pg_as[@]}" "$pg_bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w \
    -o "-p $pg_port -k $dir -c listen_addresses=127.0.0.1" start >/dev/null || { cat "$dir/server.log" >&2; return 1; }
  pg_dir=$dir
}

# new_postgres_db NAME: an empty database NAME; prints its URL.
new_postgres_db() {
  "${pg_as[@]}" "$pg_bin/createdb" -h 127.0.0.1 -p "$pg_port" -U promptgate "$1" || return 1
  echo "postgres://promptgate@127.0.0.1:$pg_port/$1"
}

stop_postgres() {
  [ -n "${pg_dir:-}" ] || return 0
  "${pg_as[@]}" "$pg_bin/pg_ctl" -D "$pg_dir/data" -m fast stop >/dev/null 2>&1 || true
  rm -rf "$pg_dir"
  pg_dir=
}
