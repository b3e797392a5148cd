/* SPDX-License-Identifier: GPL-2.0 */
/*
 * psp_compat.h - every difference between the kernels sch_psp builds for
 * (Linux 6.1 .. 7.3: Debian 12's 6.1, Debian 13's 6.12, trixie-backports'
 * 7.3), keyed on the kernel's own version macros.  sch_psp.c has no other
 * version test.
 *
 *   6.5   skb_gso_segment() moved to <net/gso.h>
 *   6.9   MODULE_ALIAS_NET_SCH() (request_module("net-sch-psp"))
 *   6.19  qdisc_skb_cb.pkt_segs, read by bstats_update()
 *   7.2   __ethtool_get_link_ksettings() takes the device's instance (ops)
 *         lock; netif_get_link_ksettings() is the variant for callers that
 *         hold it already, as qdisc_create() and qdisc_change() do
 */
#ifndef PSP_COMPAT_H
#define PSP_COMPAT_H

#include <linux/version.h>
#include <linux/ethtool.h>
#include <linux/netdevice.h>
#include <linux/module.h>
#include <net/sch_generic.h>

#if LINUX_VERSION_CODE < KERNEL_VERSION(6, 1, 0)
#error "sch_psp needs Linux 6.1 or newer (gnet_stats_basic_sync, tc_qdisc_stats_dump)"
#endif

#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 5, 0)
#include <net/gso.h>
#endif

/*
 * Link settings of @dev, from a qdisc's init (or change) callback: the
 * caller holds rtnl and, on 7.2 and later, the device's instance lock when
 * the device is ops-locked (netdev_need_ops_lock()).  Before 7.2 no kernel
 * path takes that lock in the ethtool helper, so __ethtool_get_link_ksettings()
 * (rtnl asserted) is right there; from 7.2 on it would take the instance
 * lock a second time and wait for itself forever, so use the variant that
 * asserts the lock held instead of taking it (what the kernel's own cbs and
 * taprio call).
 */
static inline int psp_get_link_ksettings(struct net_device *dev,
					 struct ethtool_link_ksettings *ks)
{
#if LINUX_VERSION_CODE >= KERNEL_VERSION(7, 2, 0)
	return netif_get_link_ksettings(dev, ks);
#else
	return __ethtool_get_link_ksettings(dev, ks);
#endif
}

/* A segment made at enqueue is one packet for bstats_update(). */
static inline void psp_skb_set_one_seg(struct sk_buff *skb)
{
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 19, 0)
	qdisc_skb_cb(skb)->pkt_segs = 1;
#endif
}

/* request_module("net-sch-psp") (tc's qdisc autoload) finds the module. */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 9, 0)
#define PSP_MODULE_ALIAS()	MODULE_ALIAS_NET_SCH("psp")
#else
#define PSP_MODULE_ALIAS()	/* before 6.9 tc asks for "sch_psp": the module's name */
#endif

#endif /* PSP_COMPAT_H */
