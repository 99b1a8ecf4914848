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
D=@D_ADDR@
hw() { echo; echo "HWTEST $*"; }
check() { # check NAME COMMAND…: one PASS/FAIL line for a shell-level case
    name=$1; shift
    if "$@"; then hw "PASS $name"; else hw "FAIL $name"; fi
}
# Everything but vfio-pci now: the suite first checks what `bind` says without it.
for m in $(cat /modules.order); do
    case $m in */vfio-pci.ko) continue ;; esac
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

load_vfio_pci() { insmod /lib/modules/vfio-pci.ko || hw "FAIL insmod vfio-pci"; }
bind_without_vfio_pci() {
    out=$(nvstore device bind $A 2>&1); rc=$?
    echo "$out"
    [ $rc -ne 0 ] && echo "$out" | grep -q "vfio-pci driver is not loaded" \
        && echo "$out" | grep -q "fix: .*modprobe vfio-pci" \
        && [ "$(basename "$(readlink /sys/bus/pci/devices/$A/driver)")" = nvme ]
}
identify_needs_bind() {
    out=$(nvstore device identify $A 2>&1); rc=$?
    echo "$out"
    [ $rc -ne 0 ] && echo "$out" | grep -q "bound to nvme, not vfio-pci" && echo "$out" | grep -q "nvstore device bind"
}
identify_without_hugepages() {
    echo 0 >/proc/sys/vm/nr_hugepages
    out=$(nvstore device identify $B 2>&1); rc=$?
    echo 32 >/proc/sys/vm/nr_hugepages
    echo "$out"
    [ $rc -eq 0 ] && echo "$out" | grep -q "no 2 MiB hugepages reserved" \
        && echo "$out" | grep -q "arena on 4 KiB (no hugepages reserved) pages"
}
unprivileged() { # unprivileged EXPECT: the error a non-root user gets
    g=$(basename "$(readlink /sys/bus/pci/devices/$B/iommu_group)")
    if [ "$1" = memlock ]; then chmod 666 /dev/vfio/vfio /dev/vfio/$g; fi
    nvme_hw as-user uid=65534 bdf=$B expect=$1
    chmod 600 /dev/vfio/$g
}
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
        && echo "$out" | grep -q "ns 2: .* of 4096 B" && echo "$out" | grep -q "arena on 2 MiB huge pages"
}
unbind_rebind() {
    nvstore device unbind $B || return 1
    [ "$(basename "$(readlink /sys/bus/pci/devices/$B/driver)")" = nvme ] || return 1
    d=$(disk_of $B) || return 1
    echo "kernel gave back /dev/$d"
    nvstore device bind $B
}

store_bench() { # the store's workloads on controller B: our driver, then the kernel's
    run_store_bench() { # DEVICE LABEL
        nvstore bench store --device "$1" --mkfs --seconds @BENCH_SECS@ --objects 2000 --label "$2" \
            >/tmp/storebench.out 2>&1
        rc=$?
        sed -n 's/^STOREBENCH/HWTEST BENCH store/p' /tmp/storebench.out
        [ $rc -eq 0 ] || { cat /tmp/storebench.out; return 1; }
    }
    run_store_bench $B vfio || return 1
    nvstore device unbind $B || return 1
    for i in $(seq 1 100); do disk_of $B >/dev/null && break; sleep 0.1; done
    d=$(disk_of $B) || return 1
    run_store_bench /dev/$d kernel || return 1
    nvstore device bind $B
}

case $mode in
suite)
    # 64 MiB of 2 MiB hugepages: the first controller's DMA arena gets them, the second falls
    # back to 4 KiB pages, so both paths run.
    echo 32 >/proc/sys/vm/nr_hugepages
    nvstore device list
    check "device bind without vfio-pci says so, with the fix; device stays on nvme" bind_without_vfio_pci
    check "device identify refuses a controller the kernel drives" identify_needs_bind
    load_vfio_pci
    check "device bind refuses a namespace held open" bind_refused_while_open
    check "device bind all controllers" nvstore device bind $A $B $C $D
    check "device bind is idempotent" nvstore device bind $B
    check "device identify through our driver (model, serial, namespaces)" identify_cli
    check "device identify without hugepages falls back to 4 KiB pages and says so" identify_without_hugepages
    unprivileged permission
    unprivileged memlock
    nvstore device list
    nvme_hw suite a=$A b=$B c=$C serial_a=@A_SERIAL@ serial_b=@B_SERIAL@
    check "device unbind gives the controller back to nvme, bind again" unbind_rebind
    if [ @BENCH@ = 1 ]; then
        nvme_hw bench bdf=$B label=file nvstore=/bin/nvstore secs=@BENCH_SECS@ || hw "FAIL benchmark (file-backed)"
        nvme_hw bench bdf=$D label=null nvstore=/bin/nvstore secs=@BENCH_SECS@ || hw "FAIL benchmark (null backend)"
        check "store benchmark on the NVMe driver and on the kernel's (same controller)" store_bench
    fi
    hw "SUITE-DONE"
    ;;
crash-write)
    load_vfio_pci
    nvstore device bind $A >/dev/null && nvme_hw crash-write bdf=$A nsid=1
    ;;
crash-verify)
    load_vfio_pci
    nvstore device bind $A >/dev/null && nvme_hw crash-verify bdf=$A nsid=1 flushed=$flushed
    ;;
esac
sync
poweroff -f
