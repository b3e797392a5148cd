// SPDX-License-Identifier: GPL-2.0
/*
 * xmitstamp: the time each packet is handed to one device's driver, for pacing measurements.
 *
 * A BTF tracepoint on net_dev_start_xmit (the moment a qdisc's output reaches the driver, where
 * tcpdump's egress tap stamps too) records bpf_ktime_get_ns() and a few header fields of every
 * skb sent by one device (xs_conf: its ifindex and namespace, 0: record nothing) into the
 * array xs_recs;
 * a record that does not fit counts in xs_count[1] instead. User space sets xs_conf and clears
 * xs_count before attaching. Nothing runs in user space per packet, so the capture does not
 * compete with the traffic for the CPU the way tcpdump does.
 *
 * CO-RE: compiled once on the host (clang -target bpf -O2 -g, harness/xmitstamp.py) with no
 * kernel headers. The few kernel structures read are declared below with only the fields used
 * and preserve_access_index, so libbpf moves each field offset to the running kernel's
 * (/sys/kernel/btf/vmlinux) at load; the one object serves Debian's 6.1 and 6.12 and the host.
 * The array's size is xs_recs' max_entries, set by user space before the load; a slot past
 * it has no element (the lookup fails), which is how a full array is noticed here.
 *
 * The device is its ifindex and its namespace's inode (xs_conf[1], what stat() of
 * /run/netns/NAME gives): an index is unique only within a namespace, and a fresh namespace's
 * first veth has the same index as its peer in another fresh one.
 * A tc program on the sender's clsact egress would see packets before the root qdisc (when
 * they are enqueued, not when they leave), one on the receiver's ingress after the backlog
 * pass, so the tracepoint is the place. tp_btf rather than raw_tp: its arguments are typed, so
 * the fields of skb and dev are plain loads the verifier checks against BTF (a third less time
 * per packet than bpf_probe_read_kernel() for each, measured on the host); only the bytes
 * behind skb->head (shared info, headers), which BTF does not describe, are copied by helper.
 * It loads on Debian's 6.1 and 6.12 and on the host (which refuses fentry, not tp_btf).
 */

typedef unsigned char __u8;
typedef unsigned short __u16;
typedef unsigned int __u32;
typedef unsigned long long __u64;

#define SEC(name) __attribute__((section(name), used))
#define __uint(name, val) int (*name)[val]
#define __type(name, val) typeof(val) *name
#define CORE __attribute__((preserve_access_index))

/* uapi values (include/uapi/linux/bpf.h) */
#define BPF_MAP_TYPE_ARRAY 2

/* helpers, by their number in the uapi's list */
static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)1;
static __u64 (*bpf_ktime_get_ns)(void) = (void *)5;
static long (*bpf_probe_read_kernel)(void *dst, __u32 size, const void *src) = (void *)113;

/* what is read of the kernel's structures: names only, offsets come from its BTF */
struct sk_buff {
	unsigned int len;
	unsigned char *head;
	unsigned char *data;
	unsigned int end;	/* sk_buff_data_t: an offset from head on 64-bit kernels */
} CORE;

struct skb_shared_info {
	unsigned short gso_size;
} CORE;

struct ns_common {
	unsigned int inum;
} CORE;

struct net {
	struct ns_common ns;
} CORE;

typedef struct {
	struct net *net;
} possible_net_t;

struct net_device {
	int ifindex;
	possible_net_t nd_net;
} CORE;


struct xs_rec {
	__u64 ts_ns;
	__u32 len;	/* skb->len: the frame without FCS, all segments of a GSO skb */
	__u16 gso_size;	/* 0: one wire packet */
	__u16 l4_off;	/* L4 header's offset from the MAC header, 0: not IPv4/IPv6 TCP/UDP */
	__u16 sport;
	__u16 dport;
	__u16 l4_hdr;	/* L4 header length */
	__u8 proto;
	__u8 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);		/* the capture's slots, set before the load */
	__type(key, __u32);
	__type(value, struct xs_rec);
} xs_recs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2);		/* [0] records claimed, [1] dropped (array full) */
	__type(key, __u32);
	__type(value, __u64);
} xs_count SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2);		/* [0] ifindex to record (0: none), [1] its netns inode */
	__type(key, __u32);
	__type(value, __u64);
} xs_conf SEC(".maps");

/* proto, the L4 header's offset and its ports/length from the first bytes of an Ethernet frame */
static __attribute__((always_inline)) void xs_headers(struct xs_rec *r, const unsigned char *data)
{
	unsigned char hdr[64], l4[16];
	__u16 eth;
	__u8 ihl;

	if (bpf_probe_read_kernel(hdr, sizeof(hdr), data))
		return;
	eth = (__u16)hdr[12] << 8 | hdr[13];
	if (eth == 0x0800) {		/* IPv4: protocol at 9, options make the header 20-60 */
		ihl = (hdr[14] & 0x0f) * 4;
		r->proto = hdr[14 + 9];
		if (ihl >= 20 && ihl <= 40)
			r->l4_off = 14 + ihl;
	} else if (eth == 0x86dd) {	/* IPv6 without extension headers: next header at 6 */
		r->proto = hdr[14 + 6];
		r->l4_off = 14 + 40;
	}
	if (r->proto != 6 && r->proto != 17)
		r->l4_off = 0;
	if (!r->l4_off || bpf_probe_read_kernel(l4, sizeof(l4), data + r->l4_off))
		return;
	r->sport = (__u16)l4[0] << 8 | l4[1];
	r->dport = (__u16)l4[2] << 8 | l4[3];
	r->l4_hdr = r->proto == 6 ? (l4[12] >> 4) * 4 : 8;
}

/* trace_net_dev_start_xmit(const struct sk_buff *skb, const struct net_device *dev) */
SEC("tp_btf/net_dev_start_xmit")
int xs_start_xmit(__u64 *ctx)
{
	struct sk_buff *skb = (struct sk_buff *)ctx[0];
	struct net_device *dev = (struct net_device *)ctx[1];
	struct skb_shared_info *shinfo;
	struct xs_rec r = {}, *slot;
	__u32 zero = 0, one = 1, idx;
	__u64 *want_if, *want_ns, *claimed, *drops;

	want_if = bpf_map_lookup_elem(&xs_conf, &zero);
	want_ns = bpf_map_lookup_elem(&xs_conf, &one);
	if (!want_if || !want_ns || !*want_if)
		return 0;
	if ((__u64)dev->ifindex != *want_if || (__u64)dev->nd_net.net->ns.inum != *want_ns)
		return 0;
	r.ts_ns = bpf_ktime_get_ns();
	r.len = skb->len;
	shinfo = (struct skb_shared_info *)(skb->head + skb->end);
	bpf_probe_read_kernel(&r.gso_size, sizeof(r.gso_size),
			      __builtin_preserve_access_index(&shinfo->gso_size));
	xs_headers(&r, skb->data);

	claimed = bpf_map_lookup_elem(&xs_count, &zero);
	drops = bpf_map_lookup_elem(&xs_count, &one);
	if (!claimed || !drops)
		return 0;
	idx = (__u32)__sync_fetch_and_add(claimed, 1);
	slot = bpf_map_lookup_elem(&xs_recs, &idx);
	if (!slot) {
		__sync_fetch_and_add(drops, 1);
		return 0;
	}
	*slot = r;
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
