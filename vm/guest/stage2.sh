#!/bin/sh
# Stage 2 of the flowpacer test VM: PID 1 in the overlay root (the host's root, read-only,
# under a tmpfs). Finishes the system mounts, runs the job described in /run/fp-out and
# powers off. The job share holds: job.env (FP_* settings), cmd.sh (the command);
# this script writes: ready, output.log, rc, dmesg.txt.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
O=/run/fp-out

off() {
    sync
    /bin/busybox poweroff -f 2>/dev/null
    echo o > /proc/sysrq-trigger
    sleep 10
}
say() { echo "fp-vm: $*" > /dev/console; }
fail() { say "FAIL stage2: $*"; echo "stage2: $*" > $O/stage2-error; off; }

mkdir -p /dev/pts /dev/shm /run/netns /run/lock /var/tmp 2>/dev/null
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
[ -e /dev/stdin ] || ln -s /proc/self/fd/0 /dev/stdin
[ -e /dev/stdout ] || ln -s /proc/self/fd/1 /dev/stdout
[ -e /dev/stderr ] || ln -s /proc/self/fd/2 /dev/stderr
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
mount -t bpf bpf /sys/fs/bpf 2>/dev/null
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
# the host's /etc/mtab may be a file; tools read /proc/self/mounts
ln -sf /proc/self/mounts /etc/mtab 2>/dev/null
hostname fp-vm 2>/dev/null
ip link set lo up || fail "ip link set lo up"

[ -r $O/job.env ] || fail "no job.env in the job share"
. $O/job.env
if [ -n "$FP_HOST_OUT" ] && [ "$FP_HOST_OUT" != "$O" ]; then
    mkdir -p "$FP_HOST_OUT" && mount --bind $O "$FP_HOST_OUT" || fail "bind $FP_HOST_OUT"
fi
for ko in $FP_INSMOD; do
    insmod "$ko" > $O/insmod.log 2>&1 || { cat $O/insmod.log > /dev/console; fail "insmod $ko"; }
done
cut -d' ' -f1 /proc/uptime > $O/ready
say "ready at $(cat $O/ready) s, running the job in $FP_CWD"

cd "$FP_CWD" || fail "cd $FP_CWD"
# A clean environment: what the job needs is set here; cmd.sh exports the caller's extras.
env -i HOME=/root PATH="$PATH" TERM=dumb LANG=C.UTF-8 USER=root LOGNAME=root \
    FLOWPACER_IN_VM=1 FLOWPACER_VM_OUT="${FP_HOST_OUT:-$O}" \
    timeout -k 10 "$FP_TIMEOUT" /bin/sh $O/cmd.sh > $O/output.log 2>&1 < /dev/null
rc=$?
echo "$rc" > $O/rc.tmp
dmesg > $O/dmesg.txt 2>&1
cut -d' ' -f1 /proc/uptime > $O/done
mv $O/rc.tmp $O/rc
say "job exited with $rc"
off
