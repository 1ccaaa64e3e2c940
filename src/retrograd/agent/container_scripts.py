"""What runs inside a sandbox container, as shell scripts for any image's `sh`: pid 1
(IDLE), the wrapper of every command (WRAPPER), the reaper after it (REAPER), the reset and
check before a reused container's next lease (RESET), and the first container's check of the
image (CHECK_IMAGE).

Every script but IDLE runs as the commands' uid; pid 1 runs as another (agent/container.py's
INIT_USER), so that `kill -9 -1` reaches every process a command could have started and
nothing else. Knows nothing of engines or pools (agent/container.py).
"""

from __future__ import annotations

WORKDIR = "/work"
MAX_ZOMBIES = 4  # a container with more (init no longer reaps) is replaced, not leased
# What a command may write to (/work, and the engines' IPC places), each emptied by RESET.
WRITABLE = ("/dev/mqueue", "/dev/shm", WORKDIR)
# The first container of a pool: the commands' uid, then every directory and regular file
# it can write to (access(2) says EROFS on a read-only mount; find says 1 for the directories
# it may not read).
CHECK_IMAGE = (
    "id -u && { find / \\( -path /proc -o -path /sys \\) -prune -o "
    "\\( -type d -o -type f \\) -writable -print 2>/dev/null; [ $? -le 1 ]; }"
)

# Kills every process of the caller's uid (kill -1 spares the caller and the namespace's
# init), again and again until kill -1 fails with ESRCH, which it does only when nothing but
# the two is left (it counts the processes it may not signal, and a zombie until it is
# reaped): a fork bomb's children born during one pass die in the next. Bounded (about 5 s);
# what is then left is the caller's to report.
REAP = """
n=0
while kill -9 -1 2>/dev/null && [ $n -lt 600 ]; do
    n=$((n + 1))
    [ $n -lt 100 ] || sleep 0.01 2>/dev/null
done
"""
# Runs every command: `timeout` kills it at the deadline, then REAP kills everything it left
# (children, a setsid or nohup job, a double fork, a process ignoring SIGTERM), so that the
# call's output ends with it. NOTE: sh reports a child killed by a signal ("Killed") on the
# stderr it holds while it waits; that is /dev/null here (the inner sh hands the command the
# real one, fd 4), for a local sandbox reports nothing either. "not found" is worded as a
# shell (and a local sandbox) words it. A command can kill or stop this wrapper (same uid),
# so REAPER runs after it, from outside the command's reach.
WRAPPER = (
    r"""
t=$1; shift
command -v "$1" >/dev/null 2>&1 || { echo "$1: command not found" >&2; exit 127; }
exec 4>&2
{ sh -c 'exec timeout --foreground -s KILL "$@" 2>&4 4>&-' sh "$t" "$@"; } 2>/dev/null
rc=$?
exec >/dev/null 2>&1 4>&-
"""
    + REAP
    + "exit $rc\n"
)
# After every command, in an `exec` of its own: exit 0 once nothing of the uid is left.
REAPER = REAP + "! kill -0 -1 2>/dev/null\n"
# pid 1 of every container, a single process: writes nothing (no byte reaches the engine's
# log or the host), idles, and leaves no zombie: with SIGCHLD ignored the kernel reaps the
# orphans a command leaves as they exit (sh's `trap '' CHLD` is not kept across exec; GNU
# env's --ignore-signal is). NOTE: alone, so that kill -1 as the commands' uid fails (ESRCH)
# exactly when nothing else is left: it counts the processes it may not signal too.
IDLE = "exec env --ignore-signal=CHLD sleep infinity </dev/null >/dev/null 2>&1"
# Before a container's next lease: no process of the last one, nothing it wrote (/work, and
# /dev/shm, /dev/mqueue and SysV IPC, the other places a uid-1000 process can write to), and
# a healthy init (sleeping in its wait, not traced, few zombies); else it is replaced.
RESET = (
    REAP
    + r"""
kill -0 -1 2>/dev/null && exit 3
chmod -R u+rwX @WRITABLE@ 2>/dev/null
find @WRITABLE@ -mindepth 1 -delete 2>/dev/null
for d in @WRITABLE@; do [ ! -d $d ] || [ -z "$(ls -A $d)" ] || exit 4; done
! command -v ipcrm >/dev/null 2>&1 || ipcrm -a 2>/dev/null
for f in /proc/sysvipc/shm /proc/sysvipc/msg /proc/sysvipc/sem; do
    [ ! -e $f ] || [ "$(wc -l < $f)" -le 1 ] || exit 5
done
read -r s < /proc/1/stat
s=${s##*) }
case ${s%% *} in S|R) ;; *) exit 6 ;; esac
grep -q '^TracerPid:[[:space:]]*0$' /proc/1/status || exit 6
z=$(grep -l '^State:[[:space:]]*Z' /proc/[0-9]*/status 2>/dev/null | wc -l)
[ "$z" -le @MAX_ZOMBIES@ ] || exit 7
""".replace("@MAX_ZOMBIES@", str(MAX_ZOMBIES)).replace("@WRITABLE@", " ".join(WRITABLE))
)
