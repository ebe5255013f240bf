# Sourced by the scripts that fetch from a package index (install-python-deps.sh, build-wheelhouse.sh,
# build-gpu-bundle.sh). pip retries a connection that is refused or times out, but not a file whose transfer is cut
# off midway: a TLS read error, a read timeout or a broken connection inside a download ends pip with a traceback
# and exit status 2, and a whole wheelhouse or image build with it.
#   with_retries CMD [ARG...]   runs CMD; when it fails with such a cut-off transfer in its output, runs it again,
#                               up to 3 tries in all, after 10 s and then 20 s. Any other failure ends it at once, with
#                               CMD's own status and output. A download keeps the files already complete in its
#                               folder, and an install the packages already in place, so a retry refetches only
#                               what was missing.
# CMD's standard output stays on standard output; its standard error is shown as it comes and also read for the cause.
WITH_RETRIES_TRIES=${WITH_RETRIES_TRIES:-3}
WITH_RETRIES_PAUSE_S=${WITH_RETRIES_PAUSE_S:-10}
# What urllib3, http.client and ssl say when a response's body stops arriving (pip's traceback names them).
WITH_RETRIES_CUT_OFF='ReadTimeoutError|Read timed out|IncompleteRead|ProtocolError|Connection broken|ConnectionResetError|SSLError|ssl\.py", line [0-9]+, in (recv_into|read)|ChunkedEncodingError|ContentDecodingError'

with_retries() {
  local try status log
  log="$(mktemp)"
  for ((try = 1; ; try++)); do
    status=0
    ("$@" 2>&1 1>&3 3>&- | tee "$log" >&2; exit "${PIPESTATUS[0]}") 3>&1 || status=$?
    if ((status == 0)) || ((try >= WITH_RETRIES_TRIES)) || ! grep -qE "$WITH_RETRIES_CUT_OFF" "$log"; then
      rm -f "$log"
      return "$status"
    fi
    echo "$(basename "$0"): a download was cut off midway (above, exit status $status); trying again in" \
      "$((WITH_RETRIES_PAUSE_S * try)) s (try $((try + 1)) of $WITH_RETRIES_TRIES): $*" >&2
    sleep "$((WITH_RETRIES_PAUSE_S * try))"
  done
}
