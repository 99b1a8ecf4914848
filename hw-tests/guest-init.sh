#!/bin/busybox sh
# /init of the hardware suite's guest (hw-tests/run fills in the @…@ values).
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts
A=@A_ADDR@
B=@B_ADDR@
C=@C_ADDR@
hw() { echo; echo "HWTEST $*"; }
check() { # check NAME COMMAND…: one PASS/FAIL line for a shell-level case
    name=$1; shift
    if "$@"; then hw "PASS $name"; else hw "FAIL $name"; fi
}
for m in $(cat /modules.order); do
    insmod "$m" || hw "FAIL insmod $m"
done
mode=suite
flushed=0
for w in $(cat /proc/cmdline); do
    case $w in
        nvstore.mode=*) mode=${w#nvstore.mode=} ;;
        nvstore.flushed=*) flushed=${w#nvstore.flushed=} ;;
    esac
done
# The kernel nvme driver takes both controllers at boot; wait for its block devices.
disk_of() { # disk_of BDF → nvmeXnY of its first namespace
    for c in /sys/bus/pci/devices/$1/nvme/nvme*; do
        [ -e "$c" ] || continue
        n=$(basename "$c")
        [ -e "/dev/${n}n1" ] && echo "${n}n1" && return 0
    done
    return 1
}
for i in $(seq 1 100); do
    disk_of $A >/dev/null && disk_of $B >/dev/null && break
    sleep 0.1
done

bind_refused_while_open() {
    d=$(disk_of $A) || return 1
    exec 3</dev/$d
    out=$(nvstore device bind $A 2>&1); rc=$?
    exec 3<&-
    echo "$out"
    [ $rc -ne 0 ] && echo "$out" | grep -q "in use" && echo "$out" | grep -q "open by pid"
}
identify_cli() {
    out=$(nvstore device identify $A) || return 1
    echo "$out"
    echo "$out" | grep -q "model     QEMU NVMe Ctrl" && echo "$out" | grep -q "serial    @A_SERIAL@" \
        && echo "$out" | grep -q "ns 2: .* of 4096 B"
}
unbind_rebind() {
    nvstore device unbind $B || return 1
    [ "$(basename "$(readlink /sys/bus/pci/devices/$B/driver)")" = nvme ] || return 1
    d=$(disk_of $B) || return 1
    echo "kernel gave back /dev/$d"
    nvstore device bind $B
}

case $mode in
suite)
    # 64 MiB of 2 MiB hugepages: the first controller's DMA arena gets them, the second falls
    # back to 4 KiB pages, so both paths run.
    echo 32 >/proc/sys/vm/nr_hugepages
    nvstore device list
    check "device bind refuses a namespace held open" bind_refused_while_open
    check "device bind all controllers" nvstore device bind $A $B $C
    check "device bind is idempotent" nvstore device bind $B
    check "device identify through our driver (model, serial, namespaces)" identify_cli
    nvstore device list
    nvme_hw suite a=$A b=$B c=$C serial_a=@A_SERIAL@ serial_b=@B_SERIAL@
    check "device unbind gives the controller back to nvme, bind again" unbind_rebind
    if [ @BENCH@ = 1 ]; then
        nvme_hw bench bdf=$B nvstore=/bin/nvstore secs=@BENCH_SECS@ || hw "FAIL benchmark"
    fi
    hw "SUITE-DONE"
    ;;
crash-write)
    nvstore device bind $A >/dev/null && nvme_hw crash-write bdf=$A nsid=1
    ;;
crash-verify)
    nvstore device bind $A >/dev/null && nvme_hw crash-verify bdf=$A nsid=1 flushed=$flushed
    ;;
esac
sync
poweroff -f
