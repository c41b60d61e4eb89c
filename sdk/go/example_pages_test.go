package pal_test

import (
	"context"
	"fmt"
	"log"

	pal "github.com/pal-sandbox/pal/sdk/go"
)

func ExampleRuntimeService_IterVMs() {
	ctx := context.Background()
	client := pal.NewClient()
	// Every VM tagged run=42, fetched 100 per request.
	it := client.Runtime.IterVMs(pal.WithMetadata("run", "42"), pal.WithPageSize(100))
	for it.Next(ctx) {
		vm := it.Item()
		fmt.Println(vm.VMID, vm.State, vm.Metadata)
	}
	if err := it.Err(); err != nil {
		log.Fatal(err)
	}
}

func ExampleRuntimeService_ExtendLifetime() {
	ctx := context.Background()
	client := pal.NewClient()
	// A VM that ends an hour after its schedule, even if busy, unless extended.
	vm, err := client.Runtime.Schedule(ctx, pal.AgentSpec{
		Metadata:      map[string]string{"run": "42"},
		LifetimeSecs:  3600,
		OnLifetimeEnd: "pause",
	})
	if err != nil {
		log.Fatal(err)
	}
	vm, err = client.Runtime.ExtendLifetime(ctx, vm.VMID, 1800)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(*vm.LifetimeSecs, vm.LifetimeEndsAt) // 5400 ...
}
