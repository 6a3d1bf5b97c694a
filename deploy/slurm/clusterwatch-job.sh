#!/usr/bin/env bash
# Registers (begin) or ends (end) the SLURM job in this environment with the clusterwatch
# coordinator: `clusterwatch job begin|end --slurm`. Called by prolog.sh and epilog.sh (slurmd's
# Prolog/Epilog, as root, on every node of the job) or from PrologSlurmctld/EpilogSlurmctld.
#
# It never fails the job: a Prolog or Epilog that exits nonzero drains the node (and a failed
# Prolog requeues the job), so whatever happens it exits 0 and says what went wrong in syslog
# (tag clusterwatch-slurm, facility daemon: `journalctl -t clusterwatch-slurm`) and on stderr.
#
# Settings, from the environment, else from /etc/clusterwatch/clusterwatch.env (the agent's
# environment file; CLUSTERWATCH_ENV_FILE names another):
#   CLUSTERWATCH_CLIENT_COORDINATOR  coordinator HOST:PORT (else CLUSTERWATCH_AGENT_COORDINATOR,
#                                    else the [client] table of /etc/clusterwatch/clusterwatch.toml)
#   CLUSTERWATCH_CLIENT_TLS_CERT, _TLS_KEY, _TLS_CA, _INSECURE
#                                    how to reach it (else the agent's CLUSTERWATCH_AGENT_* ones)
#   CLUSTERWATCH_CLIENT_TOKEN_FILE   admin token (begin and end are actions; e.g. a token named
#                                    slurm, root-only, in the coordinator's admin_token_file)
#   CLUSTERWATCH_SLURM_TIMEOUT_S     seconds to wait for the coordinator (default 5)
#   CLUSTERWATCH_BIN                 the clusterwatch executable (default: on PATH, /usr/local/bin,
#                                    /opt/clusterwatch/bin, /opt/clusterwatch/venv/bin)
#
# Usage: clusterwatch-job.sh begin|end

set -u -o pipefail # no -e: every failure below is logged, then the script still exits 0

readonly TAG=clusterwatch-slurm

log() { # log PRIORITY MESSAGE
    logger -t "$TAG" -p "daemon.$1" -- "$2" 2>/dev/null # no syslog socket (a container): stderr only
    printf '%s: %s\n' "$TAG" "$2" >&2
}

load_env_file() { # load_env_file PATH: CLUSTERWATCH_* pairs the environment does not set already
    local line key value
    [[ -r $1 ]] || return 0
    while IFS= read -r line || [[ -n $line ]]; do
        # KEY=VALUE as systemd's EnvironmentFile reads it; comments and other variables are skipped,
        # and nothing is executed (the file is not sourced).
        [[ $line =~ ^[[:space:]]*(export[[:space:]]+)?(CLUSTERWATCH_[A-Z0-9_]+)=(.*)$ ]] || continue
        key=${BASH_REMATCH[2]}
        value=${BASH_REMATCH[3]}
        if [[ $value =~ ^\"(.*)\"$ || $value =~ ^\'(.*)\'$ ]]; then
            value=${BASH_REMATCH[1]}
        fi
        [[ -v $key ]] || export "$key=$value"
    done <"$1"
}

find_clusterwatch() {
    local candidate
    for candidate in "${CLUSTERWATCH_BIN:-}" "$(command -v clusterwatch 2>/dev/null)" \
        /usr/local/bin/clusterwatch /opt/clusterwatch/bin/clusterwatch /opt/clusterwatch/venv/bin/clusterwatch; do
        if [[ -n $candidate && -x $candidate ]]; then
            printf '%s\n' "$candidate"
            return 0
        fi
    done
    return 1
}

main() {
    local action=${1:-} job=${SLURM_JOB_ID:-} context=${SLURM_SCRIPT_CONTEXT:-} bin timeout_s output rc
    case $action in
    begin | end) ;;
    *)
        log err "usage: clusterwatch-job.sh begin|end (got '${action}'); nothing done"
        return 0
        ;;
    esac
    if [[ -z $job ]]; then
        log warning "SLURM_JOB_ID is not set: not run by SLURM? nothing done"
        return 0
    fi
    load_env_file "${CLUSTERWATCH_ENV_FILE:-/etc/clusterwatch/clusterwatch.env}"
    local setting client agent
    for setting in COORDINATOR TLS_CERT TLS_KEY TLS_CA INSECURE; do # the agent's, unless given for the client
        client=CLUSTERWATCH_CLIENT_$setting agent=CLUSTERWATCH_AGENT_$setting
        if [[ -z ${!client:-} && -n ${!agent:-} ]]; then
            export "$client=${!agent}"
        fi
    done
    timeout_s=${CLUSTERWATCH_SLURM_TIMEOUT_S:-5}
    [[ $timeout_s =~ ^[0-9]+([.][0-9]+)?$ ]] || timeout_s=5
    if ! bin=$(find_clusterwatch); then
        log err "SLURM job ${job}: clusterwatch executable not found (set CLUSTERWATCH_BIN); nothing done"
        return 0
    fi
    local -a command=("$bin" job "$action" --slurm --timeout-s "$timeout_s" --log-level warning)
    if [[ $action == end ]]; then
        command+=(--reason "SLURM ${context:-epilog} on $(hostname -s 2>/dev/null || hostname)")
    fi
    # A hard cap too: the client's deadline covers the RPC, not a hung interpreter start.
    if command -v timeout >/dev/null 2>&1; then
        command=(timeout -k 2 "$((${timeout_s%.*} + 10))" "${command[@]}")
    fi
    output=$("${command[@]}" 2>&1)
    rc=$?
    output=${output//$'\n'/; }
    if ((rc == 0)); then
        log info "${output:-SLURM job ${job}: ${action} done}"
    else
        log warning "SLURM job ${job}: ${action} failed (exit ${rc}, coordinator ${CLUSTERWATCH_CLIENT_COORDINATOR:-from the config file}): ${output:-no output}; the job goes on"
    fi
    return 0
}

main "$@"
exit 0
