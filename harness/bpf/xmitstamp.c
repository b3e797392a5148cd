// SPDX-License-Identifier: GPL-2.0
/*
 * xmitstamp: the time each packet is handed to one device's driver, for pacing measurements.
 *
 * A raw tracepoint on net_dev_start_xmit (the moment a qdisc's output reaches the driver, where
 * tcpdump's egress tap stamps too) records ktime_get_ns() and a few header fields of every skb
 * sent by one device (xs_conf: its ifindex, 0: record nothing) into an array; a full array counts drops instead. User space sets xs_conf and
 * clears xs_count between runs, so one compiled program serves them all. No user space runs per packet, so the capture does not compete
 * with the traffic for the CPU the way tcpdump does.
 *
 * The ifindex alone picks the device: an index is unique within a namespace, and the test's
 * namespaces are the only traffic in the guest (a namespace's inode, read through struct net,
 * would hang on the kernel's struct layout); user space keeps only its own ports' packets.
 *
 * A tc program on the sender's clsact egress would see packets before the root qdisc (when
 * they are enqueued, not when they leave), and one on the receiver's ingress after the
 * backlog pass, so the tracepoint is the place. Compiled by bcc with -DXS_SLOTS.
 */
#include <linux/skbuff.h>
#include <linux/netdevice.h>
#include <net/net_namespace.h>

struct xs_rec {
	u64 ts_ns;
	u32 len;	/* skb->len: the frame without FCS, all segments of a GSO skb */
	u16 gso_size;	/* 0: one wire packet */
	u16 l4_off;	/* L4 header's offset from the MAC header, 0: not IPv4/IPv6 TCP/UDP */
	u16 sport;
	u16 dport;
	u16 l4_hdr;	/* L4 header length */
	u8 proto;
	u8 pad;
};

BPF_ARRAY(xs_recs, struct xs_rec, XS_SLOTS);
BPF_ARRAY(xs_count, u64, 2);	/* [0] records written, [1] dropped (array full) */
BPF_ARRAY(xs_conf, u64, 1);	/* [0] ifindex */

RAW_TRACEPOINT_PROBE(net_dev_start_xmit)
{
	struct sk_buff *skb = (struct sk_buff *)ctx->args[0];
	struct net_device *dev = (struct net_device *)ctx->args[1];
	struct xs_rec r = {};
	unsigned char *head, *data, hdr[64];
	unsigned int end;
	u32 zero = 0, one = 1, slot;
	int ifindex;
	u64 *n, *drops, *want_if;
	u16 eth;
	u8 ihl;

	want_if = xs_conf.lookup(&zero);
	if (!want_if || !*want_if)
		return 0;
	bpf_probe_read_kernel(&ifindex, sizeof(ifindex), &dev->ifindex);
	if ((u64)ifindex != *want_if)
		return 0;
	r.ts_ns = bpf_ktime_get_ns();
	bpf_probe_read_kernel(&r.len, sizeof(r.len), &skb->len);
	bpf_probe_read_kernel(&head, sizeof(head), &skb->head);
	bpf_probe_read_kernel(&end, sizeof(end), &skb->end);
	bpf_probe_read_kernel(&r.gso_size, sizeof(r.gso_size),
			      &((struct skb_shared_info *)(head + end))->gso_size);
	bpf_probe_read_kernel(&data, sizeof(data), &skb->data);
	if (bpf_probe_read_kernel(hdr, sizeof(hdr), data) == 0) {
		eth = (u16)hdr[12] << 8 | hdr[13];
		if (eth == 0x0800) {
			ihl = (hdr[14] & 0x0f) * 4;
			r.proto = hdr[23];
			if (ihl >= 20 && ihl <= 40)
				r.l4_off = 14 + ihl;
		} else if (eth == 0x86dd) {
			r.proto = hdr[20];
			r.l4_off = 54;
		}
		if (r.proto != 6 && r.proto != 17)
			r.l4_off = 0;
		if (r.l4_off) {
			unsigned char l4[16];

			if (bpf_probe_read_kernel(l4, sizeof(l4), data + r.l4_off) == 0) {
				r.sport = (u16)l4[0] << 8 | l4[1];
				r.dport = (u16)l4[2] << 8 | l4[3];
				r.l4_hdr = r.proto == 6 ? (l4[12] >> 4) * 4 : 8;
			}
		}
	}
	n = xs_count.lookup(&zero);
	drops = xs_count.lookup(&one);
	if (!n || !drops)
		return 0;
	slot = (u32)__sync_fetch_and_add(n, 1);
	if (slot >= XS_SLOTS) {
		__sync_fetch_and_add(drops, 1);
		return 0;
	}
	xs_recs.update(&slot, &r);
	return 0;
}
