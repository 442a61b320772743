package credentials_test

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/credentials"
)

// secretFields walks the API's types and returns the JSON path of every
// field that names a Secret.
func secretFields(t reflect.Type, path string, out *[]string) {
	for t.Kind() == reflect.Pointer || t.Kind() == reflect.Slice {
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct {
		return
	}
	for i := range t.NumField() {
		f := t.Field(i)
		name := strings.Split(f.Tag.Get("json"), ",")[0]
		ft := f.Type
		for ft.Kind() == reflect.Pointer || ft.Kind() == reflect.Slice {
			ft = ft.Elem()
		}
		if ft == reflect.TypeFor[v1alpha1.SecretKeyRef]() || strings.Contains(strings.ToLower(f.Name), "secret") {
			*out = append(*out, path+"."+name)
			continue
		}
		if ft.PkgPath() == reflect.TypeFor[v1alpha1.SecretKeyRef]().PkgPath() {
			secretFields(ft, path+"."+name, out)
		}
	}
}

// TestFieldsAreEveryReferenceOfTheAPI: a Secret reference added to the API
// must be added to Refs (and Fields) too, or this fails.
func TestFieldsAreEveryReferenceOfTheAPI(t *testing.T) {
	var got []string
	secretFields(reflect.TypeFor[v1alpha1.IdempotencyPolicySpec](), "spec", &got)
	slices.Sort(got)
	want := slices.Sorted(slices.Values(credentials.Fields))
	if !slices.Equal(got, want) {
		t.Fatalf("the API names Secrets at %v; credentials.Fields has %v", got, want)
	}
	// Every field turns up in Refs of a policy that sets it.
	for _, spec := range []v1alpha1.IdempotencyPolicySpec{
		{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{External: &v1alpha1.ExternalRedis{
			Addresses: []string{"r:6379"}, PasswordSecretRef: &v1alpha1.SecretKeyRef{Name: "a", Key: "k"}}}}},
		{Store: v1alpha1.StoreSpec{Type: v1alpha1.StorePostgres, Postgres: &v1alpha1.PostgresStoreSpec{URLSecretRef: v1alpha1.SecretKeyRef{Name: "b", Key: "k"}}}},
	} {
		for _, r := range credentials.Refs(&v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "p"}, Spec: spec}) {
			got = slices.DeleteFunc(got, func(f string) bool { return f == r.Field })
		}
	}
	if len(got) > 0 {
		t.Errorf("Refs never returns %v", got)
	}
}

func TestCheck(t *testing.T) {
	ref := credentials.Ref{Field: "spec.store.postgres.urlSecretRef", Name: "db", Key: "url"}
	unlabelled := &metav1.ObjectMeta{Namespace: "shop", Name: "db", Labels: map[string]string{credentials.Label: "yes"}}
	err := credentials.Check(ref, unlabelled)
	if err == nil || !strings.Contains(err.Error(), `Secret shop/db (spec.store.postgres.urlSecretRef) lacks the label idemcp.io/credentials: "true"`) ||
		!strings.Contains(err.Error(), "kubectl -n shop label secret db idemcp.io/credentials=true") {
		t.Errorf("Check of an unlabelled Secret: %v", err)
	}
	unlabelled.Labels[credentials.Label] = "true"
	if err := credentials.Check(ref, unlabelled); err != nil {
		t.Errorf("Check of a labelled Secret: %v", err)
	}
}
